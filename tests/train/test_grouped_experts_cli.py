"""The real CLI trains the same run with grouped experts as with megatron's per-expert loop: on
the same batches (the sequential run replays the grouped run's with ``--load-rollouts``) the
first STEPS seeded steps' grad norms, entropies and train/rollout log-prob gaps agree to float
tolerance.

The numbers are compared, not what sampling makes of them: where the two paths part in the
last bits (gradient clipping's norm, MKL's choice of kernel by shape) two live runs could sample
otherwise, and at which step depends on the CPU. On the same batches the trajectories still part
after a few steps (Adam's m / sqrt(v) and the clip's edges amplify last-bit differences; see
tests/backend/test_foreach_adam.py), so the comparison stops at step STEPS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
FLAGS = (
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--train-iters", str(STEPS), "--seed", "7", "--no-progress",
)  # fmt: skip
SAMPLE_METRICS = ("reward/mean", "response_length/mean")  # functions of the samples alone
RTOL = 1e-5  # gradients (the grad norm) and entropy, relative
LOGPROB_ATOL = 1e-6  # log-probs, absolute


def _run(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    """``extra``: flags after FLAGS; the rows of the training steps."""
    run_dir = tmp_path / name
    command = [sys.executable, "-m", "megatron_rl.train", *FLAGS, "--run-dir", str(run_dir)]
    result = subprocess.run(
        [*command, *extra], cwd=ROOT, capture_output=True, text=True, env=_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "grad_norm" in row]


def _env() -> dict:
    import os

    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")


@pytest.mark.slow
@pytest.mark.hardware_sensitive
def test_grouped_and_sequential_experts_train_the_same_run(tmp_path):
    dump = str(tmp_path / "rollouts")
    grouped = _run(tmp_path, "grouped", "--save-rollouts", dump)
    sequential = _run(tmp_path, "sequential", "--no-moe-grouped-gemm", "--load-rollouts", dump)
    assert len(grouped) == len(sequential) == STEPS
    for step, (g, s) in enumerate(zip(grouped, sequential, strict=True), start=1):
        for key in SAMPLE_METRICS:
            assert g[key] == s[key], f"step {step}: {key} {g[key]} != {s[key]}"
        for key in ("grad_norm", "entropy"):
            assert abs(g[key] - s[key]) <= RTOL * abs(s[key]), (step, key, g[key], s[key])
        key = "mismatch/train_rollout_logprob_abs_gap"
        assert abs(g[key] - s[key]) <= LOGPROB_ATOL, (step, key, g[key], s[key])
