"""On-policy distillation through the real CLI (``--loss-teacher`` an HF folder): a confident
teacher of another size (3 layers, 96 wide, the student's 16-token vocabulary) and a random
student. Pure distillation (``--teacher-task-weight 0``) must bring the student's sampled reverse
KL to the teacher well down, and further than the same run whose teacher only watches
(``--teacher-kl-coef 0``: RL on the task alone), on each of two seeds. R3 replay runs alongside
(the teacher touches neither routes nor the student's log-probs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from real_sglang import servers as real
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
KL = "teacher/reverse_kl_k1"


def confident_teacher(folder: Path, seed: int = 4) -> Path:
    """A random checkpoint of another size whose output layer is scaled 8x: peaked
    distributions, so a random student starts about one nat away from it."""
    folder = real.write_tiny_checkpoint(
        folder, seed=seed, num_hidden_layers=3, hidden_size=96, intermediate_size=192
    )
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8.0
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def run_cli(run_dir: Path, *flags: str) -> list[dict]:
    """The training rows of one CLI run."""
    command = [sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir)]
    command += ["--no-progress", "--train-iters", str(STEPS), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if KL in r]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.slow
@pytest.mark.hardware_sensitive  # a learning verdict over two seeds
@pytest.mark.parametrize("seed", [1, 2])
def test_pure_distillation_pulls_a_random_student_to_the_teacher(tmp_path, seed):
    teacher = str(confident_teacher(tmp_path / "teacher"))
    distilled = run_cli(
        tmp_path / "distil", "--seed", str(seed), "--loss-teacher", teacher,
        "--teacher-task-weight", "0", "--routing-replay", "r3",
    )  # fmt: skip
    watched = run_cli(
        tmp_path / "rl", "--seed", str(seed), "--loss-teacher", teacher, "--teacher-kl-coef", "0"
    )
    assert len(distilled) == len(watched) == STEPS
    start, end = mean(distilled[:3], KL), mean(distilled[-3:], KL)
    alone = mean(watched[-3:], KL)
    print(f"seed {seed}: reverse KL {start:.3f} -> {end:.3f}; RL alone -> {alone:.3f}")
    assert start > 0.5  # the student starts far from the teacher
    assert end < 0.6 * start, (start, end)
    assert end < alone - 0.15
    assert all("routing/agreement/behaviour" in r for r in distilled)  # R3 replayed


@pytest.mark.slow
@pytest.mark.hardware_sensitive  # a learning verdict
@pytest.mark.parametrize(("seed", "topk", "kl_type"), [(1, "16", "forward"), (2, "4", "mixed")])
def test_top_k_distillation_pulls_a_random_student_to_the_teacher(tmp_path, seed, topk, kl_type):
    """``--teacher-topk``: the KL over the teacher's top K as a loss term (K = 16, the whole
    vocabulary: the exact forward KL; K = 4 mixed). The loss's KL must fall well, and at K = V
    the sampled reverse KL too. At K = 4 it need not: renormalised on the teacher's top 4
    (NeMo-RL's default), the student's mass outside them is never penalised (measured: 0.91 ->
    0.96 while the top-4 KL fell 0.133 -> 0.047)."""
    teacher = str(confident_teacher(tmp_path / "teacher"))
    rows = run_cli(
        tmp_path / "distil", "--seed", str(seed), "--loss-teacher", teacher,
        "--teacher-task-weight", "0", "--teacher-topk", topk, "--teacher-kl-type", kl_type,
    )  # fmt: skip
    assert len(rows) == STEPS
    top = [mean(rows[:3], "teacher/topk_kl"), mean(rows[-3:], "teacher/topk_kl")]
    sampled = [mean(rows[:3], KL), mean(rows[-3:], KL)]
    print(f"seed {seed}, top-{topk} {kl_type}: top-K KL {top}, sampled reverse KL {sampled}")
    assert top[0] > 0.1 and sampled[0] > 0.5  # the student starts far from the teacher
    assert top[1] < 0.6 * top[0], top
    if topk == "16":
        assert sampled[1] < 0.6 * sampled[0], sampled
