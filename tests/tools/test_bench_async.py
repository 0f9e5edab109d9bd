"""tools/bench_async.py: the summary math on synthetic metrics, the plan, and (slow) a real run."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_async", ROOT / "tools" / "bench_async.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["bench_async"] = bench  # dataclasses look their module up
spec.loader.exec_module(bench)


def _write(path: Path, step_s: float, rollout_s: float, n: int = 4, **extra) -> Path:
    """``n`` steps of ``step_s`` seconds, ``rollout_s`` of them the rollout; response lengths
    alternate 10 and 20 tokens (mean 15)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")  # a step-0 eval row
        for k in range(1, n + 1):
            row = {
                "step": k,
                "accuracy": 0.1 * k,
                "time/step": step_s,
                "time/rollout": rollout_s,
                "response_length/mean": 10.0 if k % 2 else 20.0,
                "response_length/max": 64.0,
                **extra,
            }
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 99, "time/st')  # a torn last line (a crash mid-write) is skipped
    return path


def _runs(tmp_path) -> list:
    Run = bench.Run

    def run(arm, repeat, step_s, rollout_s, **extra):
        path = _write(tmp_path / arm / f"r{repeat}" / "metrics.jsonl", step_s, rollout_s, **extra)
        return Run(arm, repeat, path, 32, wall_s=30.0, load=[1.0, 2.0])

    async_extra = {"time/generation": 0.9, "time/trainer_idle": 0.1, "async/staleness_mean": 1.0}
    return [
        # repeat 0: sync 2 s steps, 1.5 s of them generation -> bound 2 / 1.5
        run("sync", 0, 2.0, 1.5),
        run("async-k1", 0, 1.0, 0.0, **async_extra),  # ratio 2.0
        run("async-k2", 0, 1.6, 0.0, **async_extra),  # ratio 1.25
        # repeat 1: sync 4 s steps, 1 s generation, 3 s training -> bound 4 / 3
        run("sync", 1, 4.0, 1.0),
        run("async-k1", 1, 2.5, 0.0, **async_extra),  # ratio 1.6
    ]


def test_the_bound_is_the_sync_step_over_its_slower_side():
    assert bench.bound(10.0, 6.0) == pytest.approx(10 / 6)  # generation is the long pole
    assert bench.bound(10.0, 3.0) == pytest.approx(10 / 7)  # training is
    assert bench.bound(10.0, 5.0) == pytest.approx(2.0)  # balanced: at most 2
    assert bench.bound(0.0, 0.0) is None


def test_spread_gives_median_range_and_a_student_t_interval():
    s = bench.spread([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["mean"], s["n"]) == (2.0, 1.0, 3.0, 2.0, 3)
    half = 4.303 * 1.0 / math.sqrt(3)  # t(0.975, 2 df) x sd 1 / sqrt(3)
    assert s["ci"] == pytest.approx((2.0 - half, 2.0 + half))
    assert bench.spread([1.5])["ci"] is None  # one repeat: no interval
    assert bench.spread([])["median"] is None
    assert bench.t_quantile(1) == 12.706 and bench.t_quantile(100) == 1.96


def test_each_arm_is_paired_with_the_sync_run_of_its_repeat(tmp_path):
    results, ratios = bench.write_summary(_runs(tmp_path), tmp_path / "summary.md", window=2)
    assert ratios["async-k1"] == pytest.approx({0: 2.0, 1: 1.6})
    assert ratios["async-k2"] == pytest.approx({0: 1.25})
    assert ratios["bound"] == pytest.approx({0: 2.0 / 1.5, 1: 4.0 / 3.0})
    by_run = {(r["arm"], r["repeat"]): r for r in results}
    sync = by_run[("sync", 0)]
    assert sync["steps"] == 4  # the step-0 eval row and the torn line are not steps
    assert sync["samples_per_s"] == pytest.approx(32 / 2.0)
    assert sync["tokens_per_s"] == pytest.approx(32 * 15 / 2.0)
    assert sync["generation_s"] == pytest.approx(1.5)  # sync: the rollout phase
    assert sync["training_s"] == pytest.approx(0.5)
    tokens = 32 * (10 + 20 + 10 + 20)  # response tokens of the 4 steps
    assert sync["generation_ms_per_token"] == pytest.approx(1e3 * 4 * 1.5 / tokens)
    fast = by_run[("async-k1", 0)]
    assert fast["generation_s"] == pytest.approx(0.9)  # async: time/generation
    assert fast["training_s"] is None  # overlapped: step - generation means nothing
    assert fast["trainer_idle_s"] == pytest.approx(0.1)
    assert fast["generation_ms_per_token"] == pytest.approx(1e3 * 4 * 0.9 / tokens)
    assert fast["final_accuracy"] == pytest.approx((0.3 + 0.4) / 2)
    text = (tmp_path / "summary.md").read_text()
    assert "| 0 | 2.00 | 1.25 | 1.33 |" in text  # repeat 0: async-k1, async-k2, bound
    assert "| 1 | 1.60 | - | 1.33 |" in text  # async-k2 did not run in repeat 1
    half = 12.706 * math.sqrt(0.08) / math.sqrt(2)  # sd of (2.0, 1.6), 1 df
    low, high = 1.8 - half, 1.8 + half
    assert f"| async-k1 | 1.80 | 1.60 .. 2.00 | 1.80 | {low:.2f} .. {high:.2f} | 2 |" in text
    assert "| bound | 1.33 | 1.33 .. 1.33 | 1.33 |" in text
    assert "Response length (mean per run): 15.0 .. 15.0 tokens" in text


def test_a_failed_run_is_reported_and_left_out(tmp_path):
    runs = _runs(tmp_path)
    runs[1].failed = "exit 1; see logs/async-k1-repeat0.log"
    _, ratios = bench.write_summary(
        runs, tmp_path / "summary.md", window=2, skipped=["arm partial skipped: refused"]
    )
    assert ratios["async-k1"] == pytest.approx({1: 1.6})
    text = (tmp_path / "summary.md").read_text()
    assert "- async-k1 repeat 0 failed: exit 1" in text
    assert "- arm partial skipped: refused" in text


def test_a_nan_step_time_stops_the_summary(tmp_path):
    runs = [bench.Run("sync", 0, _write(tmp_path / "m.jsonl", float("nan"), 1.0), 32)]
    with pytest.raises(ValueError, match="time/step holds NaN"):
        bench.write_summary(runs, tmp_path / "summary.md", window=2)


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "accuracy_vs_time.png"
    bench.plot(_runs(tmp_path), png, window=2, samples={"sync": 32, "async-k1": 32, "async-k2": 32})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plan_interleaves_rotated_arms_paired_by_seed_with_threads_set(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.ARMS, "refused", ["--max-staleness", "2"])  # the trainer says no
    argv = [
        "--out", str(tmp_path), "--repeats", "2", "--train-iters", "3",
        "--torch-threads", "1", "--server-threads", "1",
        "--arms", "sync", "async-k2", "refused",
    ]  # fmt: skip
    args = bench.parse_args(argv)
    planned, skipped = bench.plan(args, [])
    assert [(r.arm, r.repeat) for r, _, _ in planned] == [
        ("sync", 0), ("async-k2", 0), ("async-k2", 1), ("sync", 1),
    ]  # fmt: skip
    assert len(skipped) == 1 and skipped[0].startswith("arm refused skipped")
    for run, flags, server in planned:
        assert flags[flags.index("--torch-threads") + 1] == "1"
        assert flags[flags.index("--seed") + 1] == str(1234 + run.repeat)  # paired per repeat
        assert flags[flags.index("--rollout-engine") + 1] == "sglang"
        assert ("--async-rollout" in flags) == (run.arm != "sync")
        assert "--sglang-url" not in flags  # each run's server gets its own port
        assert server[server.index("--torch-threads") + 1] == "1"
        assert server[server.index("--vocab-size") + 1] == "16"  # the built-in task's tokenizer
        assert server[server.index("--seed") + 1] == str(1234 + run.repeat)
        assert run.samples_per_step == 4 * 8  # SETTING: 4 prompts x 8 samples


def test_arms_must_include_sync():
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "async-k1", "async-k2"])


@pytest.mark.slow
def test_two_arms_with_their_own_servers_write_the_summary(tmp_path):
    out = tmp_path / "bench"
    argv = ["--out", str(out), "--repeats", "1", "--train-iters", "2"]
    assert bench.main([*argv, "--arms", "sync", "async-k1"]) == 0
    text = (out / "summary.md").read_text()
    assert "| sync | 0 | 2 |" in text and "| async-k1 | 0 | 2 |" in text
    assert "| async-k1 | " in text.split("Over repeats")[1]  # a paired ratio was formed
    assert (out / "accuracy_vs_time.png").exists()
    assert (out / "logs" / "async-k1-repeat0.server.log").read_text().count("loopback server on")
