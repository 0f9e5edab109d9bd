"""The warm start: a real command that writes the same checkpoint bytes for the same seed, is
cached, and whose checkpoint the RL trainer loads for two steps of --task addition-trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "2", "--batch-size", "4", "--num-examples", "64", "--no-eval"]


def _warm_start(out: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_rl.study.warm_start", "--out", str(out), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("warm") / "seed7"
    result = _warm_start(out, "--seed", "7", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_same_seed_writes_identical_checkpoint_bytes(warm_dir, tmp_path):
    again = tmp_path / "again"
    result = _warm_start(again, "--seed", "7", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted(p.name for p in warm_dir.iterdir() if p.name != "warm_start.json")
    assert "config.json" in files and any(name.endswith(".safetensors") for name in files)
    assert files == sorted(p.name for p in again.iterdir() if p.name != "warm_start.json")
    for name in files:
        assert (warm_dir / name).read_bytes() == (again / name).read_bytes(), name
    recipe = json.loads((warm_dir / "warm_start.json").read_text())
    assert recipe["recipe"]["seed"] == 7 and recipe["recipe"]["steps"] == 2
    assert 0 < recipe["metrics"]["train/loss"] < 3.0  # below ln 16 = 2.77 plus slack, finite


@pytest.mark.slow
def test_rerun_is_cached_and_another_recipe_is_refused(warm_dir):
    before = {p.name: p.stat().st_mtime_ns for p in warm_dir.iterdir()}
    cached = _warm_start(warm_dir, "--seed", "7", *SMALL)
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert "already in" in cached.stderr
    assert {p.name: p.stat().st_mtime_ns for p in warm_dir.iterdir()} == before
    other = _warm_start(warm_dir, "--seed", "8", *SMALL)
    assert other.returncode == 2 and "another recipe" in other.stderr


@pytest.mark.slow
def test_rl_cli_trains_two_steps_of_the_trace_task_from_the_warm_start(warm_dir, tmp_path):
    command = [
        sys.executable, "-m", "megatron_rl.train", "--task", "addition-trace",
        "--model", str(warm_dir), "--train-iters", "2", "--torch-threads", "1",
        "--max-response-length", "128", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--micro-batch-size", "8",
        "--run-dir", str(tmp_path / "run"), "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 1 <= row["response_length/mean"] <= 128
        assert 0.0 <= row["accuracy"] <= 1.0
