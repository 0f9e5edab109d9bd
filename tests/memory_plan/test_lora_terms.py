"""The plan's LoRA terms against the real model with adapters: the frozen base, the adapters'
parameters, megatron DDP's gradient buffers (over the adapters only; sizes, padding and buckets
with the distributed optimizer) and Adam's state after one step, on the tiny Qwen3-MoE and
DeepSeek-V3 models, attention-only to every linear layer, routed-expert adapters per expert and
shared."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from memory_plan_testing import make_layout

from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.lora.apply import add_adapters
from megatron_rl.lora.config import LoRAConfig
from megatron_rl.memory_plan import ModelShape, PlanOptions, grad_buffers, plan_memory
from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config

CASES = {  # name -> (preset, dtype, distributed optimizer, targets, expert adapters)
    "qwen3-attention-bf16-distopt": ("tiny", "bfloat16", True, "attention", "per-expert"),
    "deepseek-all-dense-bf16-distopt":
        ("tiny-deepseek", "bfloat16", True, "all_dense", "per-expert"),
    "qwen3-all-linear-fp32": ("tiny", "float32", False, "all_linear", "per-expert"),
    "deepseek-all-linear-shared-fp32": ("tiny-deepseek", "float32", False, "all_linear", "shared"),
}  # fmt: skip


def _adapted(case: str):
    preset, dtype, distributed, targets, experts = CASES[case]
    config = preset_config(preset)
    model = build_model(config, ModelOptions(dtype=dtype), spec="local")
    lora = LoRAConfig(lora_rank=8, lora_targets=targets, lora_experts=experts)
    add_adapters(model, lora, seed=1)
    options = PlanOptions(
        params_dtype=dtype,
        distributed_optimizer=distributed,
        lora_rank=8,
        lora_targets=targets,
        lora_experts=experts,
    )
    ddp = wrap_for_training(model, use_distributed_optimizer=distributed)
    return config, ddp, options


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_counts_the_frozen_base_and_the_adapters_as_the_model_holds_them(ws1, case):
    config, ddp, options = _adapted(case)
    stage = plan_memory(config, make_layout(), options).stages[0]
    counts = {"dense": 0, "expert": 0, "adapters": 0}
    for name, param in ddp.module.named_parameters():
        kind = "adapters" if ".lora_" in name else "expert" if ".experts." in name else "dense"
        counts[kind] += param.numel() * param.element_size()
        assert param.requires_grad == (kind == "adapters")
    assert stage.term("parameters: dense").nbytes == counts["dense"]
    assert stage.term("parameters: experts").nbytes == counts["expert"]
    assert stage.term("parameters: LoRA adapters").nbytes == counts["adapters"] > 0
    real = ddp.buffers + ddp.expert_parallel_buffers
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in real)
    assert stage.term("gradient buffers").nbytes == grad_bytes
    planned = grad_buffers(
        ModelShape.from_hf(config),
        make_layout(),
        0,
        distributed_optimizer=options.distributed_optimizer,
        lora=options.lora(),
    )
    assert [b.numel for b in planned] == [b.numel for b in real]
    if options.distributed_optimizer:  # the padded layout, bucket for bucket
        assert [list(b.buckets) for b in planned] == [
            [tuple(i) for i in b.bucket_indices] for b in real
        ]


@pytest.mark.parametrize("case", list(CASES))
def test_adam_state_is_the_adapters_only(ws1, case):
    config, ddp, options = _adapted(case)
    optimizer = build_optimizer(
        ddp,
        OptimizerConfig(lr=1e-3, use_distributed_optimizer=options.distributed_optimizer),
    )
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    optimizer.zero_grad()
    logits = causal_lm_logits(ddp, ids[:, :-1])
    F.cross_entropy(
        logits.float().reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)
    ).backward()
    assert optimizer.step() is not None
    state = 0
    inner = optimizer.inner
    for opt in getattr(inner, "chained_optimizers", None) or [inner]:
        torch_opt = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
        for entry in torch_opt.state.values():
            state += sum(
                entry[k].numel() * entry[k].element_size() for k in ("exp_avg", "exp_avg_sq")
            )
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, attr, None) or []:
                state += sum(p.numel() * p.element_size() for p in group)
    stage = plan_memory(config, make_layout(), options).stages[0]
    planned = stage.term("optimizer: dense").nbytes + stage.term("optimizer: experts").nbytes
    assert planned == state


def test_a_30b_a3b_lora_layout_trains_in_a_fraction_of_the_memory():
    """Qwen3-30B-A3B on one 8-GPU node (EP 8, DP 8), bf16, the distributed optimizer: with rank-32
    adapters on every linear layer the gradient buffers and Adam state are the adapters' (over
    20x smaller than full fine-tuning's), the frozen base the same parameters."""
    from megatron_rl.memory_plan import load_model_config
    from megatron_rl.memory_plan.layout import Layout
    from megatron_rl.parallel import ParallelConfig

    config = load_model_config("qwen3-30b-a3b")
    layout = Layout.from_world_size(ParallelConfig(expert_parallel=8), 8)
    full = plan_memory(config, layout, PlanOptions()).stages[0]
    lora = plan_memory(config, layout, PlanOptions(lora_rank=32, lora_targets="all_linear")).stages[
        0
    ]
    for term in ("gradient buffers", "optimizer: dense", "optimizer: experts"):
        assert lora.term(term).nbytes * 20 < full.term(term).nbytes, term
    assert lora.term("parameters: dense").nbytes == full.term("parameters: dense").nbytes
