"""The plan's counted terms against the real tiny model in megatron DDP: parameters, grad and
(padded) param buffers, megatron's buffer layout, and Adam state after a step, on one rank and
per rank over two."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from memory_plan_testing import make_layout, tiny_model

from megatron_rl.memory_plan import (
    ModelShape,
    ParamTensor,
    PlanOptions,
    grad_buffers,
    load_model_config,
    megatron_buffer,
    plan_memory,
)

TINY_CASES = {
    "tiny-fp32-distopt": ("tiny", "float32", True, {}),
    "tiny-bf16-distopt": ("tiny", "bfloat16", True, {}),
    "tiny-bf16": ("tiny", "bfloat16", False, {}),
    "tiny-dense-tied-fp32": ("tiny-dense-tied", "float32", False, {}),
    "tiny-dense-tied-bf16-distopt": ("tiny-dense-tied", "bfloat16", True, {}),
    "tiny-shared-expert-qkv-bias-bf16-distopt": (
        "tiny",
        "bfloat16",
        True,
        {"shared_expert_intermediate_size": 48, "attention_bias": True},
    ),
    # multi-latent attention (q / kv down and up projections, latent norms), an ungated shared
    # expert, the first layer dense, the router's expert_bias a buffer (not a parameter)
    "tiny-deepseek-bf16-distopt": ("tiny-deepseek", "bfloat16", True, {}),
    "tiny-deepseek-fp32": ("tiny-deepseek", "float32", False, {}),
    "tiny-deepseek-no-q-lora-bf16-distopt": (
        "tiny-deepseek",
        "bfloat16",
        True,
        {"q_lora_rank": None},
    ),
    # GQA with q/k/v biases and qk-norm, two dense layers, an ungated shared expert
    "tiny-glm-bf16-distopt": ("tiny-glm", "bfloat16", True, {}),
    "tiny-glm-no-qk-norm-fp32": ("tiny-glm", "float32", False, {"use_qk_norm": False}),
}


def _plan_for(config, model, dtype: str):
    options = PlanOptions(
        params_dtype=dtype,
        distributed_optimizer=model.ddp_config.use_distributed_optimizer,
        reference="gpu",
    )
    return plan_memory(config, make_layout(), options).stages[0]


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_parameter_and_grad_buffer_bytes_match_thetiny_model(ws1, case):
    name, dtype, distributed, overrides = TINY_CASES[case]
    config, model = tiny_model(name, dtype, distributed, **overrides)
    stage = _plan_for(config, model, dtype)

    dense = expert = 0
    for param_name, param in model.module.named_parameters():
        nbytes = param.numel() * param.element_size()
        if ".experts." in param_name:
            expert += nbytes
        else:
            dense += nbytes
    assert stage.term("parameters: dense").nbytes == dense
    assert stage.term("parameters: experts").nbytes == expert
    assert stage.term("reference model").nbytes == dense + expert

    real = model.buffers + model.expert_parallel_buffers
    assert all(b.grad_data.dtype == torch.float32 for b in real)
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in real)
    assert stage.term("gradient buffers").nbytes == grad_bytes
    params = list(model.module.parameters())
    assert all(p.main_grad.dtype == torch.float32 for p in params)
    assert sum(p.main_grad.numel() for p in params) == sum(p.numel() for p in params)

    # megatron's own buffer layout: sizes, padding and buckets
    planned = grad_buffers(
        ModelShape.from_hf(config),
        make_layout(),
        0,
        distributed_optimizer=model.ddp_config.use_distributed_optimizer,
    )
    assert [(b.numel, list(b.buckets), list(b.param_ranges)) for b in planned] == [
        (
            b.numel,
            [tuple(i) for i in b.bucket_indices],
            sorted((start, end) for start, end, _ in b.param_index_map.values()),
        )
        for b in real
    ]
    if model.ddp_config.use_distributed_optimizer:
        param_data = sum(b.param_data.numel() * b.param_data.element_size() for b in real)
        assert stage.term("parameter buffer padding").nbytes == param_data - dense - expert
    print(case, "params", dense + expert, "grad buffers", grad_bytes)


def _adam_state_bytes(inner) -> tuple[int, int]:
    """(bytes, tensors) of Adam m, v (and megatron's fp32 master params) of an optimizer."""
    total = tensors = 0
    for opt in getattr(inner, "chained_optimizers", None) or [inner]:
        torch_opt = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
        for state in torch_opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                total += state[key].numel() * state[key].element_size()
            tensors += 1
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, attr, None) or []:
                total += sum(p.numel() * p.element_size() for p in group)
    return total, tensors


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_optimizer_state_matches_the_optimizer_after_one_step(ws1, case):

    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer
    from megatron_rl.model import causal_lm_logits

    name, dtype, distributed, overrides = TINY_CASES[case]
    config, model = tiny_model(name, dtype, distributed, **overrides)
    kwargs = {"lr": 1e-3, "clip_grad": 1.0}
    if "use_distributed_optimizer" in {f.name for f in dataclasses.fields(OptimizerConfig)}:
        kwargs["use_distributed_optimizer"] = model.ddp_config.use_distributed_optimizer
    optimizer = build_optimizer(model, OptimizerConfig(**kwargs))
    tokens_BT = torch.randint(
        0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    optimizer.zero_grad()
    logits_BTV = causal_lm_logits(model, tokens_BT[:, :-1])
    loss = F.cross_entropy(
        logits_BTV.float().reshape(-1, config.vocab_size), tokens_BT[:, 1:].reshape(-1)
    )
    loss.backward()
    assert optimizer.step() is not None

    actual, tensors = _adam_state_bytes(optimizer.inner)
    assert tensors == len(list(model.parameters()))  # every parameter has state (one rank)
    stage = _plan_for(config, model, dtype)
    expected = stage.term("optimizer: dense").nbytes + stage.term("optimizer: experts").nbytes
    per_param = 12 if dtype == "bfloat16" else 8  # m + v (+ fp32 master)
    assert expected == actual == per_param * stage.params.total


def test_distributed_optimizer_shards_follow_megatron_padding():
    # named order a (100 elements), b (30); megatron lays them out reversed: b at 0, a at 64
    tensors = [ParamTensor("a", 100), ParamTensor("b", 30, expert=True)]
    buffer = megatron_buffer(tensors, group_size=2, distributed=True, expert=False)
    assert buffer.param_ranges == ((0, 30), (64, 164))
    assert (buffer.numel, buffer.param_numel, buffer.buckets) == (256, 130, ((0, 256),))
    assert buffer.shard_numel(0) == (64, 30)  # [0, 128): all of b, 64 of a
    assert buffer.shard_numel(1) == (36, 0)
    assert buffer.fullest_shard() == (64, 30)
    plain = megatron_buffer(tensors, group_size=2, distributed=False, expert=False)
    assert (plain.numel, plain.param_ranges) == (130, ((0, 30), (30, 130)))
    # a tied embedding split over pipeline stages gets a bucket of its own
    tied = [ParamTensor("norm", 10), ParamTensor("output_layer", 100, shared_embedding=True)]
    buffer = megatron_buffer(tied, group_size=1, distributed=True, expert=False)
    assert buffer.buckets == ((0, 128), (128, 256))


def _sharding_worker(rank, world_size, init_method, tmp_dir, parallel_kwargs, name) -> None:
    """One rank: preset ``name`` in bf16, megatron's distributed optimizer, one step; saves what
    this rank holds (parameter, buffer and Adam-state bytes)."""
    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer
    from megatron_rl.model import causal_lm_logits

    init_distributed(
        ParallelConfig(**parallel_kwargs),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    config, model = tiny_model(name, "bfloat16", True)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, clip_grad=0.0))
    tokens_BT = torch.randint(
        0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    optimizer.zero_grad()
    logits_BTV = causal_lm_logits(model, tokens_BT[:, :-1])
    F.cross_entropy(
        logits_BTV.float().reshape(-1, config.vocab_size), tokens_BT[:, 1:].reshape(-1)
    ).backward()
    assert optimizer.step() is not None
    real = model.buffers + model.expert_parallel_buffers
    params = dict(model.module.named_parameters())
    result = {
        "dense": sum(p.numel() for n, p in params.items() if ".experts." not in n),
        "expert": sum(p.numel() for n, p in params.items() if ".experts." in n),
        "grad_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in real),
        "param_buffer": sum(b.param_data.numel() for b in real),
        "adam_bytes": _adam_state_bytes(optimizer.inner)[0],
    }
    torch.save(result, os.path.join(tmp_dir, f"result{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("name", "parallel"),
    [
        ("tiny", {}),
        ("tiny", {"expert_parallel": 2}),
        ("tiny", {"tensor_parallel": 2, "sequence_parallel": True}),
        # MLA at TP 2: the local spec splits the q / kv down projections (TE's would not)
        ("tiny-deepseek", {"tensor_parallel": 2, "sequence_parallel": True}),
        ("tiny-glm", {"tensor_parallel": 2, "sequence_parallel": True}),
    ],
    ids=["dp2", "ep2-dp2", "tp2-sp", "deepseek-tp2-sp", "glm-tp2-sp"],
)
def test_two_ranks_match_the_plan_per_rank(tmp_path, name, parallel):
    from qwen3_moe_testing import spawn_ranks

    spawn_ranks(_sharding_worker, tmp_path, 2, parallel, name)
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    config = load_model_config(name)
    layout = make_layout(2, **parallel)
    options = PlanOptions(params_dtype="bfloat16", spec="local")  # the spec tiny_model builds
    stage = plan_memory(config, layout, options).stages[0]
    padding = stage.term("parameter buffer padding").nbytes // 2
    for result in results:
        assert (result["dense"], result["expert"]) == (stage.params.dense, stage.params.expert)
        assert result["grad_bytes"] == stage.term("gradient buffers").nbytes
        assert result["param_buffer"] == stage.params.total + padding
    fullest = stage.term("optimizer: dense").nbytes + stage.term("optimizer: experts").nbytes
    assert max(result["adam_bytes"] for result in results) == fullest
    print(parallel, [result["adam_bytes"] for result in results], fullest)
