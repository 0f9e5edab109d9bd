"""The study's command end to end: five arms of ``--recipe study``, one of each kind of run (the
reference GRPO, an EPIC variant, R2, R3 and R3 record-only), train for real (2 seeds, 2 steps, the
router-noise mismatch at staleness 8) and the summary holds their held-out metrics. The few-step
version of docs/study.md's command; what it proves is the pipeline (real trainer runs, resume,
summary, curves), not the study's numbers. Every one of the 13 arms' command lines passes the
trainer's parser in `test_every_study_arm_command_line_passes_the_trainer_parser`: the other
eight differ from these five in objective settings only (tests/losses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_compare_runs import compare_runs

from megatron_rl.recipes import STUDY

ROOT = Path(__file__).resolve().parents[2]
SEEDS = 2
ARMS = ("grpo", "epic", "grpo-r2", "grpo-r3", "grpo-r3rec")
COMMAND = (
    "tools/compare_runs.py", "--recipe", "study", "--losses", *ARMS, "--preset", "mismatch-noise",
    "--staleness", "8", "--seeds", str(SEEDS), "--jobs", "2", "--train-iters", "2",
    "--rollout-batch-size", "2", "--final-window", "1",
    "--", "--device", "cpu", "--eval-interval", "2", "--torch-threads", "1",
)  # fmt: skip
REPLAY_MODES = {"grpo-r2": "r2", "grpo-r3": "r3", "grpo-r3rec": "r3"}  # the others: "off"


def _table(summary: str) -> dict[str, dict[str, str]]:
    """The first markdown table of ``summary.md``: arm -> column title -> cell."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| arm | K |"))
    titles = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(titles, cells, strict=True))
    return rows


def _number(cell: str) -> float:
    mean, _, half = cell.partition(" ± ")
    assert half, cell  # "mean ± half-width"
    return float(mean)


def test_every_study_arm_command_line_passes_the_trainer_parser():
    from megatron_rl.train.config import parse_args

    args = compare_runs.parse_args(list(COMMAND[1:]))
    assert args.losses == list(ARMS) and set(ARMS) < set(STUDY.arms)
    args.losses = None  # all the recipe's arms
    arms, _ = compare_runs.build_grid(args)
    assert [arm.name for arm in arms] == [f"{arm}-N8" for arm in STUDY.arms]
    for arm in arms:
        # a distillation arm's teacher is the run's (megatron_rl/recipes.py)
        teacher = ["--loss-teacher", "sglang:http://teacher:30000"] if "opd" in arm.loss else []
        config = parse_args([*compare_runs.arm_flags(arm, args), *args.extra, *teacher])
        assert config.objective.loss == STUDY.arms[arm.loss][1], arm.name
        assert config.engine.rollout_router_noise == 0.05 and config.updates_per_rollout == 8
        assert config.replay.mode == REPLAY_MODES.get(arm.loss, "off")


@pytest.mark.slow
def test_five_study_arms_train_for_real_and_reports_held_out_metrics(tmp_path):
    out = tmp_path / "study"
    command = [sys.executable, COMMAND[0], "--out", str(out), *COMMAND[1:]]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    logs = "\n".join(p.read_text()[-1500:] for p in (out / "logs").glob("*.log"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + logs
    arms = [f"{arm}-N8" for arm in ARMS]
    table = _table((out / "summary.md").read_text())
    assert list(table) == arms
    for arm in arms:
        row = table[arm]
        assert row["K"] == str(SEEDS), row
        assert 0 <= _number(row["final held-out mean@k"]) <= _number(row["final held-out pass@k"])
        assert _number(row["final held-out pass@k"]) <= 1
        assert _number(row["final entropy"]) > 0 and _number(row["peak RSS MiB"]) > 100
        if arm.removesuffix("-N8") in REPLAY_MODES:
            assert _number(row["routing bytes / rank"]) > 0, row
        if arm.removesuffix("-N8") in {"grpo-r3", "grpo-r3rec"}:  # engine routes compared
            assert 0 < _number(row["agreement behaviour"]) < 1, row  # the noise flips routes
        for seed in range(1, SEEDS + 1):
            run_dir = out / arm / f"seed{seed}"
            flags = json.loads((run_dir / "done.json").read_text())["flags"]
            assert flags[flags.index("--rollout-router-noise") + 1] == "0.05"
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            evaluated = [r for r in rows if "eval/mean@8" in r]
            assert [r["step"] for r in evaluated] == [2], arm
            assert all(0 <= r["eval/mean@8"] <= r["eval/pass@8"] <= 1 for r in evaluated)
    differences = (out / "summary.md").read_text().split("Differences from the reference arm")
    assert len(differences) == 2 and all(f"| {arm} |" in differences[1] for arm in arms[1:])
    assert (out / "curves.png").stat().st_size > 10_000
    # the same command again resumes: every run is finished, nothing trains
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    total = len(arms) * SEEDS
    assert f"{total} of {total} runs already finished; 0 to run" in again.stdout
