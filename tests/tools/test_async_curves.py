"""tools/async_curves.py without the trainer: summary.md and the plot from synthetic metrics."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("async_curves", ROOT / "tools" / "async_curves.py")
async_curves = importlib.util.module_from_spec(spec)
sys.modules["async_curves"] = async_curves  # dataclasses look their module up
spec.loader.exec_module(async_curves)


def _write(path: Path, accuracy: list[float], step_s: float, async_run: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for k, acc in enumerate(accuracy, start=1):
            row = {"step": k, "accuracy": acc, "time/step": step_s}
            if async_run:
                row.update(
                    {
                        "async/staleness_mean": 0.0 if k == 1 else 1.0,
                        "async/overlap_fraction": 0.5,
                        "async/dropped_batches": 0.0,
                    }
                )
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 99, "accur')  # a torn last line (a crash mid-write) is skipped
    return path


def _runs(tmp_path) -> list:
    # sync: 0.9 trailing mean (window 3) first at step 5 = 5 x 0.2 s; async: at step 6, 6 x 0.1 s
    sync = [0.1, 0.5, 0.8, 0.95, 1.0, 1.0, 0.9]
    fast = [0.1, 0.3, 0.6, 0.9, 0.9, 0.95, 1.0]
    never = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    Run = async_curves.Run
    return [
        Run("grpo", "sync", 1, _write(tmp_path / "gs" / "metrics.jsonl", sync, 0.2, False), 128),
        Run("grpo", "async", 1, _write(tmp_path / "ga" / "metrics.jsonl", fast, 0.1, True), 128),
        Run("vespo", "sync", 1, _write(tmp_path / "vs" / "metrics.jsonl", sync, 0.2, False), 128),
        Run("vespo", "async", 1, _write(tmp_path / "va" / "metrics.jsonl", never, 0.1, True), 128),
    ]


def test_trailing_mean():
    assert async_curves.trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [None, 1.5, 2.5, 3.5]


def test_summary_numbers_and_markdown(tmp_path):
    runs = _runs(tmp_path)
    results = async_curves.write_summary(runs, tmp_path / "summary.md", window=3, target=0.9)
    by_arm = {r["arm"]: r for r in results}
    sync, fast, never = by_arm["grpo-sync"], by_arm["grpo-async"], by_arm["vespo-async"]
    assert sync["steps"] == 7 and sync["reach_step"] == 5
    assert sync["reach_s"] == pytest.approx(1.0)
    assert fast["reach_step"] == 6 and fast["reach_s"] == pytest.approx(0.6)
    assert never["reach_step"] is None and never["reach_s"] is None
    assert sync["final_accuracy"] == pytest.approx((1.0 + 1.0 + 0.9) / 3)
    assert sync["samples_per_s"] == pytest.approx(128 / 0.2)
    assert fast["samples_per_s"] == pytest.approx(128 / 0.1)
    assert fast["staleness_mean"] == pytest.approx(6 / 7) and sync["staleness_mean"] is None
    text = (tmp_path / "summary.md").read_text()
    assert "| grpo-async | 1 | 7 | 6 | 0.6 | 0.95 |" in text
    assert "| vespo-async | 1 | 7 | - | - |" in text
    assert "| grpo | 1 | 2.00 | 0.60 |" in text  # async/sync samples/s and time-to-0.9
    assert "| vespo | 1 | 2.00 | - |" in text  # async never reached 0.9


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "accuracy_vs_time.png"
    async_curves.plot(_runs(tmp_path), png, window=3, target=0.9)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_interleaves_arms_with_equal_threads(tmp_path):
    args = async_curves.parse_args(
        ["--out", str(tmp_path), "--seeds", "1", "2", "--torch-threads", "1", "--train-iters", "3"]
    )
    planned = async_curves.plan(args, [])
    assert [(r.arm, r.seed) for r, _ in planned] == [
        (arm, seed)
        for seed in (1, 2)
        for arm in ("grpo-sync", "grpo-async", "vespo-sync", "vespo-async")
    ]
    for run, flags in planned:
        assert flags[flags.index("--torch-threads") + 1] == "1"
        assert ("--async-rollout" in flags) == (run.mode == "async")
        assert run.metrics_path.name == "metrics.jsonl"
        assert run.samples_per_step == 16 * 8  # the main job's 16 prompts x 8 samples
