"""The real CLI with ``--logprobs-on-sampling-support`` at top-k 4, top-p 0.7: the in-process
engine records each token's support and its renormalised log-prob, and the trainer's old
log-probs, renormalised on the same supports, equal them to float rounding (the fp32 engine holds
the trainer's weights). Against the same run without the option (the same draws: both sample
with the same rule and generators), the behaviour log-probs rise by exactly the log of the
support's missing mass, and the trainer follows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FLAGS = (
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
    "--global-batch-size", "16", "--train-iters", "1", "--seed", "3", "--no-progress",
    "--top-k", "4", "--top-p", "0.7",
)  # fmt: skip
GAP = "mismatch/train_rollout_logprob_abs_gap"


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[dict, list[dict]]:
    """(the step's metrics row, the dumped samples) of a one-step run."""
    run_dir, dump = tmp_path / name, tmp_path / f"{name}-rollouts"
    command = [sys.executable, "-m", "megatron_rl.train", *FLAGS, "--run-dir", str(run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    result = subprocess.run(
        [*command, "--save-rollouts", str(dump), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step_file,) = sorted(dump.glob("step_*/rank_*.pt"))
    return next(r for r in rows if GAP in r), torch.load(step_file, weights_only=True)["samples"]


@pytest.mark.slow  # two CLI runs
def test_the_trainer_renormalises_on_the_engines_supports(tmp_path):
    row, samples = _run(tmp_path, "support", "--logprobs-on-sampling-support")
    plain_row, plain = _run(tmp_path, "plain")
    assert row[GAP] < 1e-5, row[GAP]  # the trainer's log mu_S equals the engine's
    assert plain_row[GAP] < 1e-5, plain_row[GAP]
    sizes = torch.cat([(s["support_RK"] >= 0).sum(dim=1) for s in samples])
    assert sizes.max() <= 4 and sizes.max() > 1
    rise = []
    for s, p in zip(samples, plain, strict=True):
        assert p["support_RK"] is None
        assert s["response_ids"].tolist() == p["response_ids"].tolist()  # the same draws
        assert bool((s["rollout_logprobs"] >= p["rollout_logprobs"] - 1e-6).all())
        rise.append(s["rollout_logprobs"] - p["rollout_logprobs"])
    rise = torch.cat(rise)
    assert float(rise.max()) > 0.05  # supports that miss mass: the renormalisation shows
    # a one-token support is drawn with probability 1: its log-prob is 0
    single = sizes == 1
    if bool(single.any()):
        logprobs = torch.cat([s["rollout_logprobs"] for s in samples])
        assert float(logprobs[single].abs().max()) < 1e-6
