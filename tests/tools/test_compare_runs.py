"""megatron-rl study (megatron_rl/cli/study.py, also tools/compare_runs.py) without the trainer:
resume of an interrupted study, and summary.md."""

import json
import math
import sys
from pathlib import Path

import pytest

from megatron_rl.cli import study as compare_runs

ROOT = Path(__file__).resolve().parents[2]

# A stand-in trainer: logs its call, fails when asked to (an interrupted study), else writes
# 4 steps of metrics whose accuracy depends on the loss and the seed.
FAKE_TRAINER = """
import json, os, sys
argv = sys.argv[1:]
flag = lambda name: argv[argv.index(name) + 1]
loss, seed, run_dir = flag("--loss"), int(flag("--seed")), flag("--run-dir")
with open(os.environ["CALLS"], "a") as calls:
    calls.write(f"{loss} {seed}\\n")
if loss in os.environ.get("FAIL_LOSSES", "").split():
    sys.exit(3)
os.makedirs(run_dir, exist_ok=True)
base = 0.5 if loss == "grpo" else 0.8
with open(os.path.join(run_dir, "metrics.jsonl"), "w") as out:
    for step in range(1, 5):
        row = {"step": step, "accuracy": base + 0.01 * seed + 0.02 * step, "grad_norm": 1.0,
               "entropy": 2.0, "routing/agreement/behaviour": 0.9,
               "routing/agreement/behaviour/layer_1": 0.95, "routing/bytes_per_rank": 100.0,
               "grpo/clip_frac_high": 0.1, "grpo/clip_frac_low": 0.05, "time/step": 0.1}
        out.write(json.dumps(row) + "\\n")
"""


def _study(tmp_path, *extra):
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    return [
        "--out", str(tmp_path / "study"), "--seeds", "2", "--jobs", "2",
        "--losses", "grpo", "vespo", "--replay", "r3rec", "--staleness", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--trainer-command", f"{sys.executable} {fake}", *extra,
    ]  # fmt: skip


def _calls(path: Path) -> list[str]:
    return sorted(path.read_text().split("\n")[:-1]) if path.exists() else []


@pytest.mark.slow
def test_an_interrupted_study_reruns_only_unfinished_runs(tmp_path, monkeypatch, capsys):
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("FAIL_LOSSES", "vespo")
    assert compare_runs.main(_study(tmp_path)) == 1  # vespo's runs fail
    out = tmp_path / "study"
    assert (out / "grpo-r3rec-N2" / "seed1" / "done.json").exists()
    assert not (out / "vespo-r3rec-N2" / "seed1" / "done.json").exists()
    assert "failed runs" in (out / "summary.md").read_text()
    # a run killed after writing metrics but before its marker is unfinished, too
    (out / "grpo-r3rec-N2" / "seed2" / "done.json").unlink()
    calls.unlink()
    monkeypatch.delenv("FAIL_LOSSES")
    assert compare_runs.main(_study(tmp_path)) == 0
    assert _calls(calls) == ["grpo 2", "vespo 1", "vespo 2"]
    marker = json.loads((out / "vespo-r3rec-N2" / "seed2" / "done.json").read_text())
    assert marker["peak_rss_mb"] > 1 and marker["wall_s"] > 0
    assert "--seed" in marker["flags"]
    calls.unlink()
    assert compare_runs.main(_study(tmp_path)) == 0  # everything finished: nothing runs
    assert _calls(calls) == []
    summary = (out / "summary.md").read_text()
    assert "| grpo-r3rec-N2 | 2 |" in summary and "| vespo-r3rec-N2 | 2 |" in summary
    assert (out / "curves.png").stat().st_size > 10_000
    # the same folder with other trainer flags is refused, naming the fix
    with pytest.raises(SystemExit, match="use another --out"):
        compare_runs.main(_study(tmp_path, "--train-iters", "7"))


def test_grid_skips_meaningless_arms_and_names_arms_stably():
    args = compare_runs.parse_args(
        ["--losses", "grpo", "--replay", "off", "r3", "--staleness", "1",
         "--routing-dtype", "auto", "uint8", "--rollout-correction", "none", "icepop",
         "--preset", "mismatch", "--rollout-dtype", "bfloat16", "float32"]
    )  # fmt: skip
    arms, skipped = compare_runs.build_grid(args)
    names = [arm.name for arm in arms]
    assert "grpo-off-N1" in names and "grpo-r3-N1-uint8-icepop" in names
    assert "grpo-r3-N1-fp32" in names  # not the preset's dtype: named
    assert "grpo-off-N1-uint8" not in names and "grpo-r3-N1-icepop-fp32" not in names
    assert any("--routing-dtype only matters" in note for note in skipped)
    with pytest.raises(ValueError, match="--staleness 3 does not divide"):
        compare_runs.arm_flags(compare_runs.Arm("grpo", "off", 3), args)


def _runs(base: float, seeds=(1, 2, 3), spike=False) -> list[dict]:
    runs = []
    for seed in seeds:
        rows = [
            {"step": s, "accuracy": base + 0.01 * seed * s, "grad_norm": 9.0 if spike and s == 3
             else 1.0, "entropy": 1.0, "mismatch/train_rollout_logprob_abs_gap": 1e-3,
             "routing/agreement/behaviour/layer_1": 0.9, "routing/agreement/behaviour": 0.9}
            for s in range(1, 11)
        ]  # fmt: skip
        runs.append(compare_runs.run_scalars(rows, {"wall_s": 10.0, "peak_rss_mb": 500.0}, 0.9, 3))
    return runs


def test_summary_states_which_differences_are_within_the_interval():
    arms = {"ref": _runs(0.3), "same": _runs(0.3), "better": _runs(0.8, spike=True)}
    text = compare_runs.summary(arms, threshold=0.9, window=3, header=["# Study"])
    assert text.startswith("# Study")
    row = next(line for line in text.splitlines() if line.startswith("| better | 3 |"))
    # final accuracy over steps 8..10: 0.8 + 0.01 * seed * 9 -> mean over seeds 0.98
    assert "0.98 ±" in row
    assert "(reached: 3/3)" in row and "(reached: 0/3)" in text
    assert [run["grad_spikes"] for run in arms["better"]] == [1, 1, 1]  # 9 > 3 x median 1
    assert [run["grad_spikes"] for run in arms["ref"]] == [0, 0, 0]
    assert "| same | final accuracy | 0 | [" in text and "within CI" in text
    assert "| better | final accuracy |" in text and "| higher |" in text
    assert "layer_1" in text


def test_summary_with_one_seed_has_infinite_intervals():
    text = compare_runs.summary({"a": _runs(0.3, seeds=(1,)), "b": _runs(0.5, seeds=(1,))},
                                threshold=0.9, window=3)  # fmt: skip
    assert "± inf" in text and "undefined (K < 2)" in text
    assert math.isinf(compare_runs.stats.mean_ci([1.0])[1])


def test_a_recipe_study_runs_the_papers_arms_with_their_objective_and_protocol():
    """``--recipe epic-paper``: one arm per Table 2 method, each with its clipping parameters and
    the shared protocol; the trainer's parser accepts every arm's command line."""
    from megatron_rl.train.config import parse_args

    args = compare_runs.parse_args(["--recipe", "epic-paper", "--staleness", "8"])
    arms, _ = compare_runs.build_grid(args)
    names = [arm.name for arm in arms]
    assert names == [f"{arm}-N8" for arm in compare_runs.get_recipe("epic-paper").arms]
    by_name = {arm.name: compare_runs.arm_flags(arm, args) for arm in arms}
    ctpo = parse_args(by_name["ctpo-N8"])
    assert ctpo.objective.loss == "ctpo" and ctpo.objective.loss_config.clip_low == 0.025
    assert ctpo.rollout.dynamic_sampling and ctpo.rollout.over_sampling_ratio == 0.1
    assert ctpo.updates_per_rollout == 8 and ctpo.rollout.rollout_batch_size == 16
    assert parse_args(by_name["grpo-r3-N8"]).replay.mode == "r3"
    subset = compare_runs.parse_args(
        ["--recipe", "epic-paper", "--losses", "epic", "ripo", "--staleness", "8"]
    )
    assert [a.loss for a in compare_runs.build_grid(subset)[0]] == ["epic", "ripo"]
    with pytest.raises(SystemExit):
        compare_runs.parse_args(["--recipe", "epic-paper", "--losses", "vespo"])


def test_the_final_held_out_score_is_summarised_when_runs_evaluate():
    rows = [{"step": s, "accuracy": 0.5, "eval/mean@8": 0.1 * s} for s in range(1, 6)]
    assert compare_runs.run_scalars(rows, {}, 0.9, 2)["final_eval"] == pytest.approx(0.45)
    assert math.isnan(compare_runs.run_scalars([{"step": 1}], {}, 0.9, 2)["final_eval"])


@pytest.mark.parametrize(("preset", "noise"), [("long", 0.0), ("long-stress", 0.05)])
def test_the_long_presets_train_the_addition_task_from_the_given_warm_start(
    tmp_path, preset, noise
):
    from megatron_rl.train.config import parse_args

    warm = tmp_path / "warm"
    common = ["--recipe", "study", "--preset", preset, "--staleness", "8", "--losses", "epic"]
    with pytest.raises(SystemExit):  # no --warm-start
        compare_runs.parse_args(common)
    with pytest.raises(SystemExit):  # a folder without warm_start.json
        compare_runs.parse_args([*common, "--warm-start", str(warm)])
    warm.mkdir()
    (warm / "warm_start.json").write_text("{}")
    args = compare_runs.parse_args([*common, "--warm-start", str(warm)])
    arms, _ = compare_runs.build_grid(args)
    flags = compare_runs.arm_flags(arms[0], args)
    assert flags[flags.index("--model") + 1] == str(warm)
    config = parse_args([*flags, "--seed", "1"])
    assert config.task.task == "addition-trace" and config.optimizer.lr == 1e-4
    assert config.engine.rollout_router_noise == noise
    assert config.engine.rollout_dtype == "bfloat16"
    with pytest.raises(SystemExit):  # a preset without a warm start refuses one
        compare_runs.parse_args(["--preset", "mismatch", "--warm-start", str(warm)])


def test_each_run_records_the_revision_in_force_when_it_started(tmp_path):
    # a study runs for hours and commits land between its jobs: the second job, started after
    # a "commit", must not carry the revision the study began with
    revisions = iter(["aaaa", "bbbb"])
    jobs = [
        compare_runs.Job("arm", seed, tmp_path / f"s{seed}", tmp_path / f"s{seed}.log", [])
        for seed in (1, 2)
    ]
    script = "import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.mkdir(); "
    script += "(p / 'metrics.jsonl').write_text('{}')"
    failed = compare_runs.run_jobs(
        jobs,
        1,
        lambda job: [sys.executable, "-c", script, str(job.run_dir)],
        echo=lambda line: None,
        marker_extra=lambda: {"revision": next(revisions)},
    )
    assert failed == []
    markers = [json.loads((job.run_dir / "done.json").read_text()) for job in jobs]
    assert [m["revision"] for m in markers] == ["aaaa", "bbbb"]
