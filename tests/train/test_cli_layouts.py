"""The real entry point under torchrun on a matrix of parallel layouts, 2 gloo ranks, 2 steps.

Each arm runs ``torchrun --nproc-per-node 2 -m megatron_rl.train`` as a user would (not a test
harness) and checks the exit code and the metrics file: both steps written, finite losses, and
the routing metrics of every MoE layer of the model (global layer numbers) on every layout, so
a pipeline stage that reports only its own layers fails here. Every arm also evaluates on the
held-out prompts and every other one refills its batches by dynamic sampling, so their
collectives run on every layout. The arms cross the layouts with routing replay (r2 / r3; off
and r3 record-only on the uneven split), sync and async rollouts and the KL term (the full suite,
`make test`; the fast lane keeps the harness tests of the same layouts).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from ports import torchrun
from real_sglang.servers import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
SMALL = (
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--max-response-length", "3",
)  # fmt: skip
PP2 = ("--pipeline-model-parallel-size", "2")
UNEVEN = (*PP2, "--decoder-first-pipeline-num-layers", "1")
TP2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
EP2 = ("--expert-model-parallel-size", "2")
DP2 = ("--use-distributed-optimizer", "--overlap-grad-reduce")
R2, R3 = ("--routing-replay", "r2"), ("--routing-replay", "r3")
RECORD = (*R3, "--routing-record-only")
ASYNC, KL = ("--async-rollout",), ("--kl-coef", "0.01")
# every arm evaluates (before the first step and after each) and every other one refills its
# batch by dynamic sampling: both run collectives over the layout's groups
EVAL, DYNAMIC = ("--eval-interval", "1", "--eval-before-train"), ("--dynamic-sampling",)

# interleaved: 2 model chunks per stage (rank 0 holds layers 1 and 3, rank 1 layers 2 and 4)
VP2 = (*PP2, "--virtual-pipeline-model-parallel-size", "2")
LAYOUTS = {
    "pp2": PP2,
    "pp2-uneven": UNEVEN,
    "tp2sp": TP2,
    "ep2": EP2,
    "dp2-distopt-overlap": DP2,
    "pp2-vp2": VP2,
}
REPLAYS = {"off": (), "r2": R2, "r3": R3, "r3record": RECORD}


def _arms() -> dict[str, tuple[tuple[str, ...], bool]]:
    """Every layout x r2 and r3; without replay and R3 record-only: one layout, the uneven split
    (the other layouts train without replay in the harness tests: pipeline, data-parallel,
    checkpoints; record-only records and compares as r3 does, without replaying); async
    rollouts on every other arm, the KL term on every third; all in the full suite (each starts
    torchrun: too slow for the fast lane)."""
    arms = {}
    for i, (layout, layout_flags) in enumerate(LAYOUTS.items()):
        for j, (replay, replay_flags) in enumerate(REPLAYS.items()):
            if replay in ("off", "r3record") and layout != "pp2-uneven":
                continue
            use_async, use_kl, use_dynamic = (i + j) % 2 == 1, (i + j) % 3 == 0, j % 2 == 1
            extra = (ASYNC if use_async else ()) + (KL if use_kl else ()) + EVAL
            extra += DYNAMIC if use_dynamic else ()
            parts = ["async"] * use_async + ["kl"] * use_kl + ["dyn"] * use_dynamic
            name = "-".join([layout, replay, *parts])
            arms[name] = (layout_flags + replay_flags + extra, True)
    return arms


ARMS = _arms()


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """The tiny preset with 4 layers (2 per stage, or 1 + 3), vocabulary of the built-in task."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "hf", num_hidden_layers=4)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "arm",
    [pytest.param(a, marks=[pytest.mark.slow] if slow else []) for a, (_, slow) in ARMS.items()],
)
def test_the_cli_under_torchrun_runs_the_layout(arm, four_layers, tmp_path):
    flags, _ = ARMS[arm]
    run_dir = tmp_path / "run"
    command = [
        *torchrun(2), "-m", "megatron_rl.train",
        "--model", str(four_layers), "--run-dir", str(run_dir), "--device", "cpu",
        "--no-progress", "--train-iters", str(STEPS), "--torch-threads", "1", *SMALL, *flags,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evaluated = [r for r in rows if "eval/mean@8" in r]
    assert [r["step"] for r in evaluated] == list(range(STEPS + 1)), rows
    assert all(0 <= r["eval/mean@8"] <= r["eval/pass@8"] <= 1 for r in evaluated)
    rows = [r for r in rows if "grad_norm" in r or r["step"] > 0]  # the step rows
    assert len(rows) == STEPS
    if "--dynamic-sampling" in flags:
        assert all(r["dynamic_sampling/groups_drawn"] >= 4 for r in rows)
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad and "grad_norm" in row, bad or sorted(row)
    if "--routing-replay" in flags:  # every phase that compared routes: all 4 layers
        keys = [k for k in rows[-1] if k.startswith("routing/agreement/") and "/layer_" in k]
        phases = {k.split("/")[2] for k in keys}
        assert "update" in phases or "--routing-record-only" in flags, sorted(rows[-1])
        for phase in phases:
            layers = {k for k in keys if k.split("/")[2] == phase}
            want = {f"routing/agreement/{phase}/layer_{n}" for n in (1, 2, 3, 4)}
            assert layers == want, (phase, sorted(layers))
