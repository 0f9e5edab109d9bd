"""The run's learning curve as a self-contained SVG: one panel per metric against the step.

Written by plain string formatting, so the end of every run costs milliseconds and imports
nothing (matplotlib took ~0.95 s a process on the CI machine: 0.78 s of imports, 0.17 s of
drawing, paid by each of the suite's hundreds of CLI runs). Any browser or image viewer opens it;
the numbers themselves are in ``metrics.jsonl`` (`megatron_rl.train.run_logger.read_metrics`).
Panel ``p`` maps a point ``(step, value)`` to ``x = left + (step - s0) / (s1 - s0) * width`` and
``y = top + (v1 - value) / (v1 - v0) * height``, over the panel's step and value ranges.
"""

from __future__ import annotations

import math
import os
from xml.sax.saxutils import escape

from megatron_rl.atomic_io import atomic_write_text
from megatron_rl.svg_axes import padded_span, step_ticks
from megatron_rl.train.run_logger import read_metrics

WIDTH, PANEL_HEIGHT = 640, 200
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 36, 28  # margins around the plotting area of a panel
COLOR = "#1f77b4"


def plot_learning_curve(
    metrics_jsonl: str, svg_path: str, keys: tuple[str, ...] = ("accuracy", "reward/mean")
) -> str:
    """One panel per metric of ``keys`` found in the file, against the step; returns svg_path.

    Metrics absent from the file are left out; ValueError when none of ``keys`` is present.
    """
    records = read_metrics(metrics_jsonl)
    series = {}
    for key in keys:
        points = [(r["step"], float(r[key])) for r in records if _finite(r.get(key))]
        if points:
            series[key] = points
    if not series:
        available = sorted({k for r in records for k in r} - {"step"})
        raise ValueError(f"none of {list(keys)} is in {metrics_jsonl}; it has {available}")
    title = os.path.basename(os.path.dirname(os.path.abspath(metrics_jsonl)))
    height = TOP + len(series) * PANEL_HEIGHT + BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    for index, (key, points) in enumerate(series.items()):
        last = index == len(series) - 1
        parts.extend(_panel(key, points, TOP + index * PANEL_HEIGHT, x_label=last))
    parts.append("</svg>\n")
    os.makedirs(os.path.dirname(svg_path) or ".", exist_ok=True)
    atomic_write_text(svg_path, "\n".join(parts))
    return svg_path


def _panel(key: str, points: list[tuple[int, float]], top: float, x_label: bool) -> list[str]:
    """SVG elements of one panel: frame, grid with tick labels, the metric's line."""
    width, height = WIDTH - LEFT - RIGHT, PANEL_HEIGHT - 34
    s0, s1 = padded_span([s for s, _ in points])
    v0, v1 = padded_span([v for _, v in points])

    def x(step: float) -> float:
        return LEFT + (step - s0) / (s1 - s0) * width

    def y(value: float) -> float:
        return top + (v1 - value) / (v1 - v0) * height

    out = [f'<rect x="{LEFT}" y="{top}" width="{width}" height="{height}" fill="none" '
           'stroke="#444"/>']  # fmt: skip
    for i in range(5):
        value = v0 + (v1 - v0) * i / 4
        out.append(f'<line x1="{LEFT}" x2="{LEFT + width}" y1="{y(value):.1f}" '
                   f'y2="{y(value):.1f}" stroke="#ddd"/>')  # fmt: skip
        out.append(f'<text x="{LEFT - 4}" y="{y(value) + 4:.1f}" text-anchor="end">'
                   f"{value:.3g}</text>")  # fmt: skip
    for step in step_ticks(s0, s1):
        out.append(f'<text x="{x(step):.1f}" y="{top + height + 13}" text-anchor="middle">'
                   f"{step}</text>")  # fmt: skip
    coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
    out.append(f'<polyline points="{coords}" fill="none" stroke="{COLOR}" stroke-width="1.5"/>')
    if len(points) <= 60:
        out.extend(f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2" fill="{COLOR}"/>'
                   for s, v in points)  # fmt: skip
    middle = top + height / 2
    out.append(f'<text x="14" y="{middle:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 14 {middle:.1f})">{escape(key)}</text>')  # fmt: skip
    if x_label:
        out.append(f'<text x="{LEFT + width / 2}" y="{top + height + 27}" '
                   'text-anchor="middle">step</text>')  # fmt: skip
    return out


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
