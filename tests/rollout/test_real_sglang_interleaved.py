"""Interleaved pipeline parallelism's weight sync against the real SGLang 0.5.23 server on CPU.

The real CLI under torchrun at PP 2 x VP 2 (2 gloo ranks, 4 layers: rank 0 holds layers 0 and 2,
rank 1 layers 1 and 3) with one weight sender per stage: SGLang takes each stage's buckets, both
of its chunks, over that stage's own weight group. Server and trainer are float32, so the
server's log-probs must be the trainer's to float rounding at every step: a chunk's tensors
missing, or sent under another chunk's layer numbers, would leave the server on other weights.
Measured: gaps 9.4e-8 to 1.0e-7; with each stage sending its first chunk only (a mutation),
0.25 and 0.36 after the first and second updates.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from ports import torchrun
from real_sglang import servers as real

pytestmark = [pytest.mark.slow, pytest.mark.real_sglang, pytest.mark.xdist_group("real_sglang")]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
GAP = 1e-4  # float32 both sides (measured ~1e-7)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    real.require()
    folder = tmp_path_factory.mktemp("real_sglang_interleaved")
    model_dir = real.write_tiny_checkpoint(folder / "model", num_hidden_layers=4)
    started = real.start_server(model_dir, dtype="float32", log_path=folder / "server.log")
    try:
        started.wait_ready(timeout_s=600)
        yield started, model_dir
    finally:
        started.stop()


@pytest.mark.distributed
def test_each_stage_sends_both_its_chunks_to_the_real_server(server, tmp_path):
    server, model_dir = server
    run_dir = tmp_path / "run"
    command = [
        *torchrun(2), "-m", "megatron_rl.train",
        "--model", str(model_dir), "--run-dir", str(run_dir), "--device", "cpu",
        "--no-progress", "--rollout-engine", "sglang", "--sglang-url", server.url,
        "--weight-sync-transport", "distributed", "--pipeline-model-parallel-size", "2",
        "--virtual-pipeline-model-parallel-size", "2", "--train-iters", str(STEPS),
        "--torch-threads", "1", "--lr", "1e-2",
    ]  # fmt: skip
    log = tmp_path / "run.log"
    with log.open("w") as out:  # a file, not a pipe (see tests/rollout/torchrun_cli.py)
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=out, timeout=1800).returncode
    assert code == 0, log.read_text()[-4000:] + server.log_tail(3000)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rows = [r for r in rows if "grad_norm" in r]
    assert len(rows) == STEPS and all(r["grad_norm"] > 0 for r in rows)
    stage_mb = [rows[-1][f"weight_sync/stage_mb/{s}"] for s in (0, 1)]
    gaps = [r["mismatch/train_rollout_logprob_abs_gap"] for r in rows]
    _, info = real.request(server.url, "GET", "/model_info")
    print(f"real SGLang, PP2 x VP2 per-stage senders: stage MB {stage_mb}, log-prob gaps {gaps}")
    assert all(mb > 0 for mb in stage_mb)
    assert str(info["weight_version"]) == str(STEPS)
    assert max(gaps) < GAP, gaps
