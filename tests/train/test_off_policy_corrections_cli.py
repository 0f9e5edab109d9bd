"""Decoupled PPO, M2PO and OPSM train through the real CLI and report what they did; M2PO's
dropped tokens change the update (a run without it trains differently)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, name: str, *flags: str) -> list[dict]:
    run_dir = tmp_path / name
    command = [
        sys.executable, "-m", "megatron_rl.train", "--device", "cpu", "--train-iters", "2",
        "--rollout-dtype", "bfloat16", "--run-dir", str(run_dir), "--no-progress", *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


@pytest.mark.slow
def test_m2po_with_opsm_and_decoupled_train_through_the_cli_and_report_their_masks(tmp_path):
    """bf16 rollouts against the fp32 trainer give mu != pi_old (mean (log mu - log pi_old)^2
    ~1.5e-6 here): tau 1e-8 makes M2PO drop tokens with a 100x margin; delta 0 makes OPSM mask
    the negative-advantage sequences the step's updates moved away from."""
    m2po = _train(tmp_path, "m2po", "--rollout-correction", "m2po", "--m2po-tau", "1e-8",
                  "--opsm-delta", "0")  # fmt: skip
    decoupled = _train(tmp_path, "decoupled", "--rollout-correction", "decoupled")
    assert [r["step"] for r in m2po] == [1, 2] == [r["step"] for r in decoupled]
    for row in m2po:
        assert 0 < row["rollout_correction/m2po_masked_frac"] < 1, row
        assert 0 < row["opsm/masked_seq_frac"] < 1, row
        assert row["grad_norm"] > 0
    for row in decoupled:
        assert (
            "rollout_correction/m2po_masked_frac" not in row and "opsm/masked_seq_frac" not in row
        )
        assert row["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=0.05)
    assert m2po[0]["grad_norm"] != decoupled[0]["grad_norm"]  # the masks changed the update
