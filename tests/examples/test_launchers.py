"""The 32-GPU Qwen3-30B-A3B launcher: valid bash, and the commands it would run (DRY_RUN=1) are
accepted by the trainer's and the server launcher's own argument checks. Nothing here runs on a
GPU: this proves the launcher's wiring, not a cluster run."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.train.config import parse_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen3_moe" / "run_qwen3_30b_a3b.sh"


def _dry_run(node_rank: int, **env) -> str:
    environment = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HF_CKPT": "/shared/Qwen3-30B-A3B",
        "PROMPTS": "/shared/dapo-math-17k.parquet",
        "MASTER_ADDR": "node0",
        "ROLLOUT_HOSTS": "node2 node3",
        "NODE_RANK": str(node_rank),
        "DRY_RUN": "1",
        **env,
    }
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_launcher_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize(("loss", "replay", "staleness"), [("vespo", "off", 8), ("epic", "r3", 4)])
def test_training_node_command_passes_the_trainer_checks(loss, replay, staleness):
    out = _dry_run(0, LOSS=loss, REPLAY=replay, STALENESS=str(staleness))
    argv = shlex.split(out.strip())
    assert argv[0] == "torchrun" and "--nproc-per-node" in argv
    config = parse_args(argv[argv.index("megatron_rl.train") + 1 :])
    assert config.loss == loss and config.routing_replay == replay
    assert config.updates_per_rollout == staleness
    assert config.data_parallel_size(16) == 8  # 2 nodes x 8 GPUs, TP 2
    assert len(config.sglang_url) == 2 and config.sglang_engine_ranks == 8


def test_serving_node_starts_one_sglang_server_with_routes_for_r3():
    out = _dry_run(2, REPLAY="r3")
    assert "sglang.launch_server" in out and "--enable-return-routed-experts" in out
    assert "--tp-size 8" in out and "--ep-size 8" in out and "--skip-tokenizer-init" in out
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in out
    assert "--enable-return-routed-experts" not in _dry_run(3, REPLAY="r2")


@pytest.mark.parametrize(
    ("loss", "env", "kl"),
    [
        ("epic", {}, 1e-3),
        ("gspo", {}, 1e-3),
        ("vespo", {}, 0.0),
        ("vespo", {"KL_COEF": "0.01"}, 0.01),
    ],
)
def test_the_kl_coefficient_is_a_per_recipe_choice(loss, env, kl):
    out = _dry_run(0, LOSS=loss, **env)
    argv = shlex.split(out.strip())
    config = parse_args(argv[argv.index("megatron_rl.train") + 1 :])
    assert config.kl_coef == kl
    assert config.reference_offload and config.use_distributed_optimizer
    assert config.overlap_grad_reduce
