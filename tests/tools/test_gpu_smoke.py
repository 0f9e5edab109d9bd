"""tools/gpu_smoke.py rehearsed on the CPU: the same code a GPU run executes, at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_smoke_rehearsal_resumes_exactly_runs_every_feature_arm_the_slice_and_offload(tmp_path):
    out = tmp_path / "smoke.json"
    argv = ["--device", "cpu", "--quick", "--tokens", "128", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_smoke.py"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resume, features, throughput, slice_, offload = json.loads(out.read_text())
    assert resume["passed"] and resume["max_abs_param_diff"] == 0.0
    assert resume["run_to_run_diff"] == 0.0  # the CPU is deterministic: the floor is exact
    assert features["passed"], features["arms"]
    assert set(features["arms"]) >= {
        "vespo+r3+torch_dist",
        "epic+r2+kl",
        "cispo+async",
        "grpo+async-save",
    }
    assert throughput["sync_samples_per_s"][0] > 0 and throughput["async_samples_per_s"][0] > 0
    assert slice_["passed"] and slice_["finite"] and slice_["plan_gib"] > 0
    assert offload["passed"] and offload["exact"] and offload["host_allocations"] == 1
    assert offload["moved_bytes"] <= offload["host_arena_bytes"] < 1.05 * offload["moved_bytes"]
