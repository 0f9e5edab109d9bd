"""The Qwen3-30B-A3B LoRA launcher (`run_qwen3_30b_a3b_lora.sh`): its training node's command
passes the trainer's checks with the adapters and layout it promises, its serving node starts one
server, and the memory plan of that very command fits one node of 80 GiB and of 141 GiB GPUs
while full fine-tuning of the same layout does not fit 80 GiB (`megatron-rl plan -- COMMAND`).
DRY_RUN only: this proves the wiring and the plan, not a cluster run."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.cli import plan as plan_cli
from megatron_rl.train.config import parse_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen3_moe" / "run_qwen3_30b_a3b_lora.sh"


def _dry_run(node_rank: int, **env) -> str:
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("NODE_HOSTS", "LAUNCH_ID")}
    environment = {
        **base,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HF_CKPT": "/shared/Qwen3-30B-A3B",
        "PROMPTS": "/shared/dapo-math-17k.parquet",
        "MASTER_ADDR": "node0",
        "ROLLOUT_HOSTS": "node1",
        "NODE_RANK": str(node_rank),
        "DRY_RUN": "1",
        **env,
    }
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=environment, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _train_argv(out: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.startswith("torchrun ")]
    return shlex.split(line)


def test_the_training_node_trains_adapters_on_one_node():
    argv = _train_argv(_dry_run(0))
    assert argv[argv.index("--nnodes") + 1] == "1"
    config = parse_args(argv[argv.index("megatron_rl.train") + 1 :])
    lora = config.lora
    assert (lora.lora_rank, lora.lora_alpha, lora.lora_targets) == (32, 64.0, "all_linear")
    assert lora.lora_experts == "per-expert" and config.optimizer.lr == 1e-5
    assert config.data_parallel_size(8) == 4  # TP 2 x DP 4; EP 8 keeps the experts whole
    assert config.parallel.expert_parallel == 8 and config.parallel.expert_tensor_parallel == 1
    assert config.checkpoint.ckpt_format == "torch"  # LoRA checkpoints: adapters + base identity
    assert len(config.engine.sglang_url) == 1


def test_the_knobs_reach_the_trainer_and_the_serving_node_serves():
    argv = _train_argv(_dry_run(0, LORA_RANK="16", LORA_TARGETS="attention", LORA_LR="2e-5"))
    config = parse_args(argv[argv.index("megatron_rl.train") + 1 :])
    assert (config.lora.lora_rank, config.lora.lora_alpha) == (16, 32.0)
    assert config.lora.lora_targets == "attention" and config.optimizer.lr == 2e-5
    out = _dry_run(1)
    assert "torchrun" not in out and "sglang.launch_server" in out and "--tp-size 8" in out


def _plan(argv: list[str], gpu_gib: int, capsys) -> str:
    code = plan_cli.main(["--model", "qwen3-30b-a3b", "--gpu-gib", str(gpu_gib), "--", *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return out.splitlines()[-1]


@pytest.mark.parametrize("gpu_gib", [80, 141])
def test_the_plan_of_the_launched_command_fits_one_node(gpu_gib, capsys):
    verdict = _plan(_train_argv(_dry_run(0)), gpu_gib, capsys)
    assert verdict.startswith(f"FITS in {gpu_gib} GiB: 24.08 GiB"), verdict


def test_full_fine_tuning_of_the_same_layout_does_not_fit_80_gib(capsys):
    argv = _train_argv(_dry_run(0, TRAIN_EXTRA_ARGS="--lora-rank 0"))
    verdict = _plan(argv, 80, capsys)
    assert verdict.startswith("DOES NOT FIT in 80 GiB: 80.40 GiB"), verdict
