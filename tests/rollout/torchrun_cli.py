"""The trainer's real CLI under torchrun (2 gloo ranks on CPU), for the multi-rank rollout tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ports import torchrun

ROOT = Path(__file__).resolve().parents[2]
SMALL = (
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--max-response-length", "3",
)  # fmt: skip


def torchrun_train(model: Path, run_dir: Path, *flags: str, steps: int = 2) -> list[dict]:
    """``torchrun --standalone --nproc-per-node 2 -m megatron_rl.train`` with a small batch; the
    metric rows (the exit code and the output's tail are the assertion's message)."""
    command = [
        *torchrun(2), "-m", "megatron_rl.train",
        "--model", str(model), "--run-dir", str(run_dir), "--device", "cpu", "--no-progress",
        "--train-iters", str(steps), "--torch-threads", "1", *SMALL, *flags,
    ]  # fmt: skip
    # output to a file, not a pipe: torch's shared-memory manager (the tensor transport on
    # CPU) inherits the pipe and outlives the run, so reading a pipe to its end would hang
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=out, timeout=1800).returncode
    assert code == 0, log.read_text()[-8000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
