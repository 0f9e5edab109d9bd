"""Adapters installed on the tiny Qwen3-MoE and DeepSeek-V3 models: the adapted model starts as
its base, only the adapters train (megatron's DDP and optimizer see nothing else, and an update
leaves every base weight, router included, as it was), and bad targets are named."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.backend.optimizer import build_optimizer, wrap_for_training
from megatron_rl.backend.optimizer_config import OptimizerConfig
from megatron_rl.lora.apply import adapter_state, add_adapters
from megatron_rl.lora.config import LoRAConfig
from megatron_rl.model import build_model
from megatron_rl.model.builder import causal_lm_logits
from megatron_rl.model.conversion.seeded_init import init_from_seed
from megatron_rl.model.presets import preset_config

IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4]])


def _model(preset: str):
    hf_config = preset_config(preset)
    model = build_model(hf_config)
    init_from_seed(model, hf_config, seed=3)
    return model


@pytest.mark.parametrize(
    ("preset", "targets", "wrapped"),
    [
        ("tiny", "attention", {"linear_qkv", "linear_proj"}),
        ("tiny-deepseek", "all_dense", {"linear_q_up_proj", "linear_kv_up_proj", "linear_proj",
                                        "linear_fc1", "linear_fc2"}),
    ],
    ids=["qwen3-attention", "deepseek-all-dense"],
)  # fmt: skip
def test_the_adapted_model_starts_as_its_base_and_only_adapters_train(
    ws1, preset, targets, wrapped
):
    model = _model(preset)
    want = causal_lm_logits(model, IDS).detach()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = add_adapters(model, LoRAConfig(lora_rank=4, lora_targets=targets), seed=1)
    assert {n.rsplit(".", 1)[1] for n in names} == wrapped
    assert not any("router" in n for n in names)
    torch.testing.assert_close(causal_lm_logits(model, IDS), want, atol=0, rtol=0)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A" in n or ".lora_B" in n for n in trained)
    assert len(adapter_state(model)) == 2 * len(names)

    ddp = wrap_for_training(model, use_distributed_optimizer=False)
    optimizer = build_optimizer(ddp, OptimizerConfig(lr=1e-2, use_distributed_optimizer=False))
    in_optimizer = {id(p) for g in optimizer.inner.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    for _ in range(2):  # B moves at the first step, A from the second
        optimizer.zero_grad()
        logits = causal_lm_logits(ddp, IDS)
        torch.log_softmax(logits, -1)[..., 0].mean().backward()
        assert optimizer.step() is not None
    after = dict(model.named_parameters())
    for name, value in base.items():  # the base, routers and norms included, did not move
        key = name if name in after else _wrapped_name(name, names)
        assert torch.equal(after[key].detach(), value), name
    moved = [n for n, v in adapter_state(model).items() if v.abs().max() > 0 and "lora_B" in n]
    assert len(moved) == len(names)
    assert not torch.equal(causal_lm_logits(model, IDS).detach(), want)


def _wrapped_name(name: str, wrapped: list[str]) -> str:
    """A base parameter's name once its layer is wrapped: ``<layer>.base.<param>``."""
    for layer in wrapped:
        if name.startswith(layer + "."):
            return f"{layer}.base.{name[len(layer) + 1 :]}"
    raise KeyError(name)


def test_config_and_targets_are_checked(ws1):
    with pytest.raises(ValueError, match="--lora-rank=-1"):
        LoRAConfig(lora_rank=-1)
    with pytest.raises(ValueError, match="'experts' is none of the presets"):
        LoRAConfig(lora_rank=4, lora_targets="attention,experts")
    with pytest.raises(ValueError, match=r"--lora-dropout=1\.0"):
        LoRAConfig(lora_rank=4, lora_dropout=1.0)
    assert LoRAConfig(lora_rank=4, lora_targets="attention_out").target_modules() == (
        "self_attention.linear_proj",
    )
    model = _model("tiny")  # Qwen3-MoE has no dense MLP layer
    with pytest.raises(ValueError, match="no layer of this model matches"):
        add_adapters(model, LoRAConfig(lora_rank=4, lora_targets="dense_mlp"), seed=1)


def test_sharded_checkpoints_are_refused_with_adapters_for_now():
    from megatron_rl.train.checkpoint.config import CheckpointConfig
    from megatron_rl.train.config import TrainConfig

    with pytest.raises(ValueError, match="--lora-rank with --ckpt-format torch_dist"):
        TrainConfig(
            lora=LoRAConfig(lora_rank=4), checkpoint=CheckpointConfig(ckpt_format="torch_dist")
        )
    TrainConfig(lora=LoRAConfig(lora_rank=4))


def test_adapter_sync_needs_sglang_servers_that_load_adapters():
    from megatron_rl.rollout.engine_config import EngineConfig
    from megatron_rl.train.config import TrainConfig

    adapter = LoRAConfig(lora_rank=4, lora_sync="adapter")
    url = ("http://127.0.0.1:30000",)
    with pytest.raises(ValueError, match=r"needs --lora-rank > 0 \(LoRAConfig.lora_sync\)"):
        LoRAConfig(lora_sync="adapter")
    with pytest.raises(ValueError, match="--lora-sync adapter needs --rollout-engine sglang"):
        TrainConfig(lora=adapter)
    distributed = EngineConfig(kind="sglang", sglang_url=url, weight_sync_transport="distributed")
    with pytest.raises(ValueError, match="over --weight-sync-transport distributed"):
        TrainConfig(lora=adapter, engine=distributed)
    for transport in ("tensor", "disk"):
        engine = EngineConfig(kind="sglang", sglang_url=url, weight_sync_transport=transport)
        TrainConfig(lora=adapter, engine=engine)
