"""Axis helpers for the SVG charts written by string formatting (the learning curve, the
study's curves): a padded value span and round step ticks. Pure functions, no imports beyond
``math``, so a chart costs no heavy import."""

from __future__ import annotations

import math


def padded_span(values: list[float]) -> tuple[float, float]:
    """``(low, high)`` around ``values``, 5% padded; equal values get 10% of their size (or
    0.5) on each side."""
    low, high = min(values), max(values)
    pad = (high - low) * 0.05 if high > low else abs(low) * 0.1 or 0.5
    return low - pad, high + pad


def step_ticks(low: float, high: float, count: int = 6) -> list[int]:
    """Up to ``count`` + 1 integer steps in ``[low, high]``, 1, 2 or 5 times 10^k apart."""
    raw = max((high - low) / count, 1.0)
    magnitude = 10 ** math.floor(math.log10(raw))
    spacing = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / spacing) * spacing
    return [int(first + i * spacing) for i in range(count + 1) if first + i * spacing <= high]
