"""The DeepSeek-V3 (671B) and GLM-4.5 (355B) launchers (examples/deepseek_v3/,
examples/glm4_moe/, on the Qwen3-MoE launchers' common.sh): every training node's DRY_RUN command
passes the trainer's own parser and megatron-core's `TransformerConfig` checks for the preset of
the real size (MLA, the uneven pipeline split, GLM-4.5's virtual pipeline, experts / EP), every
serving node starts one SGLang server on the right checkpoint, and a layout the model file does
not have is refused. Their memory plans are in
tests/memory_plan/test_memory_plan_trainer_command.py. Nothing here runs on a GPU."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.train.config import parse_args

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK = ROOT / "examples" / "deepseek_v3" / "run_deepseek_v3.sh"
GLM = ROOT / "examples" / "glm4_moe" / "run_glm_4_5.sh"

# (launcher, preset, TRAIN_NODES) -> (PP, first / last stage layers, EP, Adam offloaded, virtual
# pipeline: None for plain 1F1B, DeepSeek-V3's 61 layers have no split into chunks)
LAYOUTS = {
    (DEEPSEEK, "deepseek-v3", 16): (8, (7, 6), 16, False, None),
    (DEEPSEEK, "deepseek-v3", 8): (8, (7, 6), 8, True, None),
    (GLM, "glm-4.5", 8): (4, (22, 22), 16, False, 2),
    (GLM, "glm-4.5", 4): (4, (22, 22), 8, True, 2),
}
IDS = ["deepseek-v3-256", "deepseek-v3-128", "glm-4.5-128", "glm-4.5-64"]


def _run(script: Path, train_nodes: int, rank: int, **env: str) -> subprocess.CompletedProcess:
    hosts = " ".join(f"node{train_nodes + i}" for i in range(train_nodes))
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environment = {
        **base,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HF_CKPT": "/shared/bf16",
        "SERVE_CKPT": "/shared/fp8",
        "PROMPTS": "/shared/dapo-math-17k.parquet",
        "MASTER_ADDR": "node0",
        "ROLLOUT_HOSTS": hosts,
        "TRAIN_NODES": str(train_nodes),
        "NODE_RANK": str(rank),
        "DRY_RUN": "1",
        **env,
    }
    return subprocess.run(
        ["bash", str(script)], cwd=ROOT, env=environment, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def _train_argv(out: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.startswith("torchrun ")]
    return shlex.split(line)


def _megatron_config(preset: str, config, monkeypatch):
    """megatron-core's `TransformerConfig` of ``preset`` under ``config``'s parallel sizes."""
    from megatron.core import parallel_state

    from megatron_rl.model.config import to_transformer_config
    from megatron_rl.model.presets import preset_config

    sizes = {
        "tensor_model_parallel": config.parallel.tensor_parallel,
        "pipeline_model_parallel": config.parallel.pipeline_parallel,
        "context_parallel": config.parallel.context_parallel,
        "expert_model_parallel": config.parallel.expert_parallel,
        "expert_tensor_parallel": 1,
    }
    for name, size in sizes.items():
        monkeypatch.setattr(parallel_state, f"get_{name}_world_size", lambda size=size: size)
    return to_transformer_config(preset_config(preset), config.model, use_te=False)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(LAYOUTS), ids=IDS)
@pytest.mark.parametrize(("loss", "replay"), [("vespo", "off"), ("epic", "r2"), ("grpo", "r3")])
def test_every_training_node_passes_the_trainer_and_megatron_checks(key, loss, replay, monkeypatch):
    script, preset, nodes = key
    pp, (first, last), ep, offloaded, virtual = LAYOUTS[key]
    for rank in range(nodes):
        result = _run(script, nodes, rank, LOSS=loss, REPLAY=replay)
        assert result.returncode == 0, result.stderr
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in result.stdout.splitlines()
        argv = _train_argv(result.stdout)
        assert argv[argv.index("--nnodes") + 1] == str(nodes)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        config = parse_args(argv[argv.index("megatron_rl.train") + 1 :])
        assert config.objective.loss == loss and config.replay.mode == replay
        parallel = config.parallel
        assert (parallel.tensor_parallel, parallel.pipeline_parallel) == (8, pp)
        assert parallel.expert_parallel == ep and parallel.sequence_parallel
        assert parallel.context_parallel == 1
        assert config.data_parallel_size(nodes * 8) == nodes * 8 // (8 * pp)
        assert (config.model.first_stage_layers, config.model.last_stage_layers) == (first, last)
        assert config.model.virtual_stages == virtual
        dp = config.data_parallel_size(nodes * 8)
        assert config.schedule.global_batch_size // (dp * config.schedule.micro_batch_size) >= pp
        assert len(config.engine.sglang_url) == nodes and config.engine.sglang_engine_ranks == 8
        assert config.engine.weight_sync_fp8_blocks == (preset == "deepseek-v3")
        assert config.optimizer.cpu_offload == offloaded
        assert config.checkpoint.ckpt_format == "torch_dist"
    megatron = _megatron_config(preset, config, monkeypatch)
    assert megatron.pipeline_model_parallel_size == pp and megatron.sequence_parallel
    assert megatron.num_layers_in_first_pipeline_stage == first
    assert megatron.num_layers_in_last_pipeline_stage == last
    assert megatron.virtual_pipeline_model_parallel_size == virtual
    assert megatron.expert_model_parallel_size == ep
    assert megatron.recompute_granularity == "full"
    if preset == "deepseek-v3":  # multi-latent attention with the release's ranks
        assert megatron.multi_latent_attention
        assert (megatron.q_lora_rank, megatron.kv_lora_rank) == (1536, 512)
        assert (megatron.moe_router_num_groups, megatron.moe_router_group_topk) == (8, 4)
    assert megatron.num_moe_experts == (256 if preset == "deepseek-v3" else 160)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(LAYOUTS), ids=IDS)
def test_every_serving_node_starts_one_sglang_server_on_the_serving_checkpoint(key):
    script, preset, nodes = key
    checkpoint = "/shared/fp8" if preset == "deepseek-v3" else "/shared/bf16"
    for rank in range(nodes, 2 * nodes):
        result = _run(script, nodes, rank, REPLAY="r3")
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert "torchrun" not in out and out.count("sglang.launch_server") == 1
        assert f"--model-path {checkpoint} " in out
        assert "--tp-size 8" in out and "--ep-size 8" in out
        assert "--mem-fraction-static 0.85" in out and "--enable-return-routed-experts" in out


@pytest.mark.parametrize(
    ("script", "nodes", "env", "message"),
    [
        (DEEPSEEK, 4, {}, "TRAIN_NODES=4: DeepSeek-V3 has layouts for 16 or 8 training nodes"),
        (GLM, 16, {}, "TRAIN_NODES=16: GLM-4.5 has layouts for 8 or 4 training nodes"),
        (DEEPSEEK, 8, {"SERVE_CKPT": ""}, "set SERVE_CKPT to the block-FP8 DeepSeek-V3 release"),
    ],
    ids=["deepseek-nodes", "glm-nodes", "deepseek-serve-ckpt"],
)
def test_a_layout_or_checkpoint_the_model_file_lacks_is_refused(script, nodes, env, message):
    result = _run(script, nodes, 0, **env)
    assert result.returncode != 0 and message in result.stderr
    assert "torchrun" not in result.stdout
