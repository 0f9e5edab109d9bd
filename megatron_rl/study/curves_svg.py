"""A study's curves as one SVG: per panel (`run_metrics.PANELS`), every arm's per-step mean over
seeds with its 95% band, or each seed's own curve (thin) when an arm has fewer than
`BAND_MIN_SEEDS` seeds (a t-band at K = 2, t = 12.7, is wider than the data).

Plain string formatting with fixed number formats (the approach of
`megatron_rl.train.learning_curve`), so the same runs give the same bytes: a committed SVG can be
regenerated and compared. Its axis helpers are restated here, not imported: importing
``megatron_rl.train`` loads torch, seconds the records' check need not pay. A panel maps
``(step, value)`` to ``x = left + (step - s0) / (s1 - s0) * width`` and
``y = top + (v1 - value) / (v1 - v0) * height``.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from megatron_rl.study import stats
from megatron_rl.study.run_metrics import OPTIONAL_PANELS, PANELS, curve
from megatron_rl.svg_axes import padded_span, step_ticks

BAND_MIN_SEEDS = 3
COLUMNS, PANEL_WIDTH, PANEL_HEIGHT = 2, 480, 230
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40  # margins around a panel's plotting area
LEGEND_ROW = 18
# ten distinguishable colours, one per arm in every panel (repeating after ten arms)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip

Series = tuple[list[int], list[float], list[float], list[dict[int, float]]]


def _series(runs: list[list[dict]], key: str) -> Series:
    """``(steps, means, half_widths, per-seed curves)`` of one arm's metric ``key``."""
    per_seed = [curve(rows, key) for rows in runs]
    steps, means, halves = stats.band(per_seed)
    return steps, means, halves, per_seed


def study_svg(curves: dict[str, list[list[dict]]]) -> str:
    """The SVG text; ``curves`` maps an arm's name to its seeds' rows (`run_metrics` rows)."""
    names = list(curves)
    panels = [
        (key, title)
        for key, title in PANELS
        if key not in OPTIONAL_PANELS
        or any(curve(rows, key) for runs in curves.values() for rows in runs)
    ]
    legend_height = LEGEND_ROW * (1 + (len(names) - 1) // 3) if names else 0
    rows_n = -(-len(panels) // COLUMNS)
    width = COLUMNS * PANEL_WIDTH
    height = legend_height + 8 + rows_n * PANEL_HEIGHT
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for index, name in enumerate(names):  # legend: three arms per line
        x, y = 16 + (index % 3) * (width // 3), 14 + (index // 3) * LEGEND_ROW
        color = PALETTE[index % len(PALETTE)]
        parts.append(f'<rect x="{x}" y="{y - 8}" width="14" height="4" fill="{color}"/>')
        parts.append(f'<text x="{x + 20}" y="{y - 2}">{escape(name)}</text>')
    for index, (key, title) in enumerate(panels):
        left = (index % COLUMNS) * PANEL_WIDTH
        top = legend_height + 8 + (index // COLUMNS) * PANEL_HEIGHT
        series = {name: _series(runs, key) for name, runs in curves.items()}
        parts.extend(_panel(title, series, names, left, top))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel(
    title: str, series: dict[str, Series], names: list[str], left: float, top: float
) -> list[str]:
    """SVG elements of one panel: title, frame, grid and tick labels, each arm's curves."""
    x0, y0 = left + LEFT, top + TOP
    width, height = PANEL_WIDTH - LEFT - RIGHT, PANEL_HEIGHT - TOP - BOTTOM
    out = [f'<text x="{x0 + width / 2:.1f}" y="{top + 18}" text-anchor="middle" '
           f'font-size="12">{escape(title)}</text>']  # fmt: skip
    steps = [s for st, *_ in series.values() for s in st]
    values = [
        v for st, means, halves, seeds in series.values() for v in _extent(means, halves, seeds)
    ]
    if not steps:
        out.append(f'<text x="{x0 + width / 2:.1f}" y="{y0 + height / 2:.1f}" '
                   'text-anchor="middle" fill="#888">(not reported)</text>')  # fmt: skip
        return out
    s0, s1 = padded_span(steps)
    v0, v1 = padded_span(values)

    def x(step: float) -> str:
        return f"{x0 + (step - s0) / (s1 - s0) * width:.1f}"

    def y(value: float) -> str:
        return f"{y0 + (v1 - value) / (v1 - v0) * height:.1f}"

    out.append(f'<rect x="{x0}" y="{y0}" width="{width}" height="{height}" fill="none" '
               'stroke="#444"/>')  # fmt: skip
    for i in range(5):
        value = v0 + (v1 - v0) * i / 4
        out.append(f'<line x1="{x0}" x2="{x0 + width}" y1="{y(value)}" y2="{y(value)}" '
                   'stroke="#ddd"/>')  # fmt: skip
        out.append(f'<text x="{x0 - 4}" y="{float(y(value)) + 4:.1f}" text-anchor="end">'
                   f"{value:.3g}</text>")  # fmt: skip
    for step in step_ticks(s0, s1):
        out.append(f'<text x="{x(step)}" y="{y0 + height + 14}" text-anchor="middle">'
                   f"{step}</text>")  # fmt: skip
    out.append(f'<text x="{x0 + width / 2:.1f}" y="{y0 + height + 28}" '
               'text-anchor="middle">step</text>')  # fmt: skip
    for index, name in enumerate(names):
        color = PALETTE[index % len(PALETTE)]
        steps_i, means, halves, seeds = series[name]
        if not steps_i:
            continue
        if len(seeds) < BAND_MIN_SEEDS:
            for points in seeds:
                out.append(_line(points, x, y, color, width=0.7, opacity=0.5))
        else:
            upper = [f"{x(s)},{y(m + h if math.isfinite(h) else m)}"
                     for s, m, h in zip(steps_i, means, halves, strict=True)]  # fmt: skip
            lower = [f"{x(s)},{y(m - h if math.isfinite(h) else m)}"
                     for s, m, h in zip(steps_i, means, halves, strict=True)]  # fmt: skip
            out.append(f'<polygon points="{" ".join(upper + lower[::-1])}" fill="{color}" '
                       'fill-opacity="0.18" stroke="none"/>')  # fmt: skip
        out.append(_line(dict(zip(steps_i, means, strict=True)), x, y, color, width=1.6))
    return out


def _extent(means: list[float], halves: list[float], seeds: list[dict[int, float]]) -> list[float]:
    """The values a panel must show for one arm: its seeds' points, or its band's edges."""
    if len(seeds) < BAND_MIN_SEEDS:
        return [v for points in seeds for v in points.values()] + list(means)
    finite = [(m, h) for m, h in zip(means, halves, strict=True) if math.isfinite(h)]
    return list(means) + [m - h for m, h in finite] + [m + h for m, h in finite]


def _line(points: dict[int, float], x, y, color: str, width: float, opacity: float = 1.0) -> str:
    """A polyline through ``{step: value}`` (a lone point is drawn as a dot)."""
    if len(points) == 1:
        ((step, value),) = points.items()
        return f'<circle cx="{x(step)}" cy="{y(value)}" r="2.5" fill="{color}"/>'
    coords = " ".join(f"{x(s)},{y(v)}" for s, v in points.items())
    alpha = f' stroke-opacity="{opacity}"' if opacity < 1 else ""
    return (f'<polyline points="{coords}" fill="none" stroke="{color}" '
            f'stroke-width="{width}"{alpha}/>')  # fmt: skip
