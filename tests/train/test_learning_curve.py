"""The end-of-run learning curve is a valid SVG with one line per metric present, each point
placed by its step and value (higher values higher up), non-finite values left out, and a
metrics file without any of the metrics refused with the metrics it has."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_rl.train.learning_curve import plot_learning_curve

SVG = "{http://www.w3.org/2000/svg}"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _lines(svg_path) -> list[list[tuple[float, float]]]:
    root = ET.parse(svg_path).getroot()  # raises on malformed XML
    return [
        [tuple(map(float, xy.split(","))) for xy in line.get("points").split()]
        for line in root.iter(f"{SVG}polyline")
    ]


def test_one_line_per_present_metric_with_points_ordered_by_step_and_value(tmp_path):
    rows = [
        {"step": s, "accuracy": s / 10, "reward/mean": [0.5, -1.0, 2.0][s % 3]}
        for s in (1, 2, 3, 4)
    ]
    rows[2]["accuracy"] = None  # logged as null (not finite): left out
    metrics = _write(tmp_path / "metrics.jsonl", rows)
    svg = plot_learning_curve(
        metrics, str(tmp_path / "out" / "curve.svg"), ("accuracy", "reward/mean", "kl")
    )
    accuracy, reward = _lines(svg)
    assert len(accuracy) == 3 and len(reward) == 4
    xs = [x for x, _ in reward]
    assert xs == sorted(xs) and len(set(xs)) == 4  # steps left to right
    ys = [y for _, y in accuracy]
    assert ys == sorted(ys, reverse=True)  # rising accuracy is drawn rising (SVG y grows down)
    by_value = sorted(zip([r["reward/mean"] for r in rows], [y for _, y in reward], strict=True))
    assert [y for _, y in by_value] == sorted([y for _, y in reward], reverse=True)
    text = Path(svg).read_text()
    assert ">accuracy<" in text and ">reward/mean<" in text and ">kl<" not in text
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["curve.svg"]  # no temporary left


def test_a_constant_metric_still_draws_inside_its_panel(tmp_path):
    metrics = _write(tmp_path / "metrics.jsonl", [{"step": s, "accuracy": 1.0} for s in (1, 2)])
    ((first, second),) = _lines(plot_learning_curve(metrics, str(tmp_path / "c.svg")))
    assert first[1] == second[1] and first[0] < second[0]


def test_a_file_without_the_metrics_is_refused_naming_what_it_has(tmp_path):
    metrics = _write(tmp_path / "metrics.jsonl", [{"step": 1, "accuracy": 0.5, "lr": 1e-3}])
    with pytest.raises(ValueError, match=r"none of \['kl'\].*'accuracy', 'lr'"):
        plot_learning_curve(metrics, str(tmp_path / "kl.svg"), keys=("kl",))
