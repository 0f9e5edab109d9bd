"""The memory plan's counted terms are exact: against the real tiny model (parameters, DDP grad
buffers, Adam state after a step), a meta-device HF model (total parameters), hand-computed
per-rank splits of Qwen3-30B-A3B, and `megatron_rl.routing.memory`. Its estimates: the local
spec's attention matrices against a CPU trace of megatron's code, and the peak timeline against
the H200's measured peaks of the GPU smoke's slice; plus validation and the CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.backend.grad_check import GRAD_CHECK_CHUNK_ELEMENTS
from megatron_rl.model.memory import (
    GIB,
    PHASE_ADAM,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_GRAD_CHECK,
    PHASE_LOGPROBS,
    Layout,
    ModelShape,
    ParamTensor,
    PlanOptions,
    attention_bytes,
    grad_buffers,
    layer_activation_bytes,
    load_model_config,
    megatron_buffer,
    megatron_stage_layers,
    optimizer_state_bytes,
    plan_memory,
    stage_params,
    stored_activations,
)
from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing import RoutingCodec, routing_state_bytes

ROOT = Path(__file__).resolve().parents[2]

# Qwen3-30B-A3B, for the hand counts below
H, V, D, E, F_MOE = 2048, 151936, 128, 128, 768
ATTN = (32 + 2 * 4) * D * H + 32 * D * H  # linear_qkv + linear_proj = 18,874,368
NORMS = 2 * H + 2 * D  # input / pre-MLP RMSNorm + q / k RMSNorm
ROUTER = E * H
EXPERT = 3 * F_MOE * H  # fc1 (gate + up) + fc2 = 4,718,592


def _layout(world_size: int | None = None, **sizes) -> Layout:
    parallel = ParallelConfig(**sizes)
    if world_size is None:
        return Layout(parallel=parallel)
    return Layout.from_world_size(parallel, world_size)


def _tiny_model(name: str, dtype: str, distributed: bool, **overrides):
    """The tiny model in megatron DDP, with the distributed optimizer's buffers if asked (and if
    this checkout's `wrap_for_training` lets the caller choose)."""
    from megatron_rl.backend.optimizer import wrap_for_training
    from megatron_rl.model import ModelOptions, build_model, preset_config

    config = preset_config(name, **overrides)
    model = build_model(config, ModelOptions(dtype=dtype), spec="local")
    if "use_distributed_optimizer" in inspect.signature(wrap_for_training).parameters:
        return config, wrap_for_training(model, use_distributed_optimizer=distributed)
    return config, wrap_for_training(model)


# ------------------------------------------------------------------------- the real tiny model
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
}


def _plan_for(config, model, dtype: str):
    options = PlanOptions(
        params_dtype=dtype,
        distributed_optimizer=model.ddp_config.use_distributed_optimizer,
        reference="gpu",
    )
    return plan_memory(config, _layout(), options).stages[0]


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_parameter_and_grad_buffer_bytes_match_the_tiny_model(ws1, case):
    name, dtype, distributed, overrides = TINY_CASES[case]
    config, model = _tiny_model(name, dtype, distributed, **overrides)
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
        _layout(),
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
    config, model = _tiny_model(name, dtype, distributed, **overrides)
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


def _sharding_worker(rank, world_size, init_method, tmp_dir, parallel_kwargs) -> None:
    """One rank: the tiny bf16 model, megatron's distributed optimizer, one step; saves what this
    rank holds (parameter, buffer and Adam-state bytes)."""
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
    config, model = _tiny_model("tiny", "bfloat16", True)
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
    "parallel",
    [{}, {"expert_parallel": 2}, {"tensor_parallel": 2, "sequence_parallel": True}],
    ids=["dp2", "ep2-dp2", "tp2-sp"],
)
def test_two_ranks_match_the_plan_per_rank(tmp_path, parallel):
    from qwen3_moe_testing import spawn_ranks

    spawn_ranks(_sharding_worker, tmp_path, 2, parallel)
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    config = load_model_config("tiny")
    layout = _layout(2, **parallel)
    stage = plan_memory(config, layout, PlanOptions(params_dtype="bfloat16")).stages[0]
    padding = stage.term("parameter buffer padding").nbytes // 2
    for result in results:
        assert (result["dense"], result["expert"]) == (stage.params.dense, stage.params.expert)
        assert result["grad_bytes"] == stage.term("gradient buffers").nbytes
        assert result["param_buffer"] == stage.params.total + padding
    fullest = stage.term("optimizer: dense").nbytes + stage.term("optimizer: experts").nbytes
    assert max(result["adam_bytes"] for result in results) == fullest
    print(parallel, [result["adam_bytes"] for result in results], fullest)


# ------------------------------------------------------------------------- Qwen3 sizes
@pytest.mark.parametrize(
    ("model", "billions", "active_billions"),
    [("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235.1, 22.2)],
)
def test_total_params_match_a_meta_device_hf_model(model, billions, active_billions):
    from transformers import Qwen3MoeForCausalLM

    config = load_model_config(model)
    with torch.device("meta"):
        hf_model = Qwen3MoeForCausalLM(config)
    direct = sum(p.numel() for p in hf_model.parameters())
    shape = ModelShape.from_hf(config)
    assert shape.total_params() == direct
    assert abs(direct / 1e9 - billions) < 0.1
    assert abs(shape.total_params(active=True) / 1e9 - active_billions) < 0.1
    # sum over all GPUs of the per-rank expert shards is the whole expert set
    layout = _layout(64, tensor_parallel=4, pipeline_parallel=2, expert_parallel=16)
    shards = sum(stage_params(shape, layout, s).expert for s in range(2))
    assert shards * 16 == shape.num_layers * shape.num_experts * shape.expert_params()


def test_qwen3_30b_total_and_active_by_hand():
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layer = ATTN + NORMS + ROUTER
    assert shape.total_params() == 48 * (layer + 128 * EXPERT) + 2 * V * H + H == 30_532_122_624
    assert shape.total_params(active=True) == 48 * (layer + 8 * EXPERT) + 2 * V * H + H


def test_per_rank_split_of_the_launcher_layout_tp2_ep8_dp8():
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layout = _layout(16, tensor_parallel=2, expert_parallel=8)
    assert (layout.data_parallel, layout.expert_data_parallel) == (8, 2)
    params = stage_params(shape, layout, 0)
    # embedding + output layer split by TP; attention split by TP; norms and router replicated
    assert params.dense == 2 * V * H // 2 + H + 48 * (NORMS + ATTN // 2 + ROUTER) == 776_943_616
    assert params.expert == 48 * (128 // 8) * EXPERT == 3_623_878_656
    # every tensor is a multiple of 64 elements and each buffer of 128: no padding anywhere
    buffers = grad_buffers(shape, layout, 0, distributed_optimizer=True)
    assert [(b.numel, b.param_numel, b.group_size) for b in buffers] == [
        (776_943_616, 776_943_616, 8),
        (3_623_878_656, 3_623_878_656, 2),
    ]
    options = PlanOptions(params_dtype="bfloat16", distributed_optimizer=True)
    dense_opt, expert_opt = optimizer_state_bytes(buffers, options)
    assert dense_opt == 12 * 776_943_616 // 8  # m, v, master over DP 8
    assert expert_opt == 12 * 3_623_878_656 // 2  # over expert-data-parallel 16 / 8
    no_dist = PlanOptions(params_dtype="float32", distributed_optimizer=False)
    buffers = grad_buffers(shape, layout, 0, distributed_optimizer=False)
    assert optimizer_state_bytes(buffers, no_dist) == (8 * params.dense, 8 * params.expert)


def test_per_rank_split_with_pipeline_and_expert_tensor_parallel():
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layout = _layout(64, tensor_parallel=4, pipeline_parallel=4, expert_parallel=16)
    stages = [stage_params(shape, layout, s) for s in range(4)]
    body = 12 * (NORMS + ATTN // 4 + ROUTER)
    assert [s.dense for s in stages] == [
        V * H // 4 + body,  # embedding on the first stage
        body,
        body,
        body + H + V * H // 4,  # final norm + output layer on the last
    ]
    assert all(s.expert == 12 * 8 * EXPERT for s in stages)

    layout = _layout(16, tensor_parallel=2, expert_parallel=4, expert_tensor_parallel=2)
    params = stage_params(shape, layout, 0)
    assert params.expert == 48 * 32 * EXPERT // 2
    assert layout.expert_data_parallel == 2

    # EP 1: megatron keeps experts in the dense buffers, sharded over DP like dense params
    layout = _layout(8, tensor_parallel=2)
    params = stage_params(shape, layout, 0)
    buffers = grad_buffers(shape, layout, 0, distributed_optimizer=True)
    assert len(buffers) == 1 and buffers[0].group_size == 4
    assert sum(optimizer_state_bytes(buffers, PlanOptions())) == 12 * params.total // 4


def test_tied_embeddings_keep_a_copy_on_the_last_pipeline_stage():
    config = load_model_config("tiny-dense-tied")
    shape = ModelShape.from_hf(config)
    one = stage_params(shape, _layout(), 0)
    two = [stage_params(shape, _layout(2, pipeline_parallel=2), s) for s in range(2)]
    embedding = shape.vocab_size * shape.hidden_size
    assert two[0].dense + two[1].dense == one.dense + embedding


def test_uneven_pipeline_split_235b():
    shape = ModelShape.from_hf(load_model_config("qwen3-235b-a22b"))
    parallel = ParallelConfig(tensor_parallel=4, pipeline_parallel=4, expert_parallel=16)
    with pytest.raises(ValueError, match="not divisible by pipeline parallel size 4"):
        Layout.from_world_size(parallel, 64).validate(shape)
    layout = Layout.from_world_size(parallel, 64, (23, 24, 24, 23))
    plan = plan_memory(shape, layout)
    assert [s.params.layers for s in plan.stages] == [23, 24, 24, 23]
    with pytest.raises(ValueError, match="middle stages must be equal"):
        Layout.from_world_size(parallel, 64, (24, 23, 24, 23)).validate(shape)


@pytest.mark.parametrize(
    ("pp", "first", "last", "stages"),
    [
        (1, None, None, (94,)),
        (2, None, None, (47, 47)),
        (4, 23, 23, (23, 24, 24, 23)),
        (4, None, 22, (24, 24, 24, 22)),
        (4, 22, None, (22, 24, 24, 24)),
        (2, 40, 54, (40, 54)),
    ],
)
def test_megatron_stage_layers_split_like_megatron(pp, first, last, stages):
    assert megatron_stage_layers(94, pp, first, last) == stages


@pytest.mark.parametrize(
    ("pp", "first", "last", "message"),
    [
        (4, 22, 23, "49 layers left after the first/last stages do not split evenly over the 2"),
        (4, None, None, "94 layers left"),
        (1, 23, None, "need pipeline parallel size > 1"),
        (2, 40, 50, "first 40 + last 50 layers != num_hidden_layers=94"),
        (4, 0, 23, "first stage layers=0: must be >= 1"),
    ],
)
def test_megatron_stage_layers_refuses_what_megatron_refuses(pp, first, last, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        megatron_stage_layers(94, pp, first, last)


def test_megatron_stage_layers_agree_with_megatrons_transformer_config(monkeypatch):
    """The split megatron-core's own `TransformerConfig` makes (and refuses) from the trainer's
    --decoder-first/last-pipeline-num-layers."""
    from megatron.core import parallel_state

    from megatron_rl.model.config import ModelOptions, to_transformer_config

    sizes = {"tensor_model_parallel": 4, "pipeline_model_parallel": 4, "context_parallel": 1}
    sizes |= {"expert_model_parallel": 8, "expert_tensor_parallel": 1}
    for name, size in sizes.items():
        monkeypatch.setattr(parallel_state, f"get_{name}_world_size", lambda size=size: size)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = load_model_config("qwen3-235b-a22b")

    def megatron_split(first, last):
        options = ModelOptions(dtype="bfloat16", first_stage_layers=first, last_stage_layers=last)
        megatron = to_transformer_config(config, options, use_te=False)
        return tuple(get_num_layers_to_build(megatron, pp_rank=rank) for rank in range(4))

    for first, last in ((23, 23), (22, None), (None, 22)):
        assert megatron_stage_layers(94, 4, first, last) == megatron_split(first, last)
    for first, last in ((22, 23), (None, 26), (None, None)):  # both refuse the same splits
        with pytest.raises((ValueError, AssertionError)):
            megatron_split(first, last)
        with pytest.raises(ValueError):
            megatron_stage_layers(94, 4, first, last)


def test_optimizer_cpu_offload_moves_the_shard_to_host_memory():
    config = load_model_config("qwen3-235b-a22b")
    layout = Layout.from_world_size(
        ParallelConfig(tensor_parallel=4, pipeline_parallel=4, expert_parallel=8),
        32,
        (23, 24, 24, 23),
    )
    base = plan_memory(config, layout, PlanOptions(micro_batch_tokens=18432))
    for fraction in (1.0, 0.5):
        options = PlanOptions(micro_batch_tokens=18432, optimizer_offload_fraction=fraction)
        plan = plan_memory(config, layout, options)
        for before, after in zip(base.stages, plan.stages, strict=True):
            state = sum(before.term(f"optimizer: {k}").nbytes for k in ("dense", "experts"))
            kept = sum(after.term(f"optimizer: {k}").nbytes for k in ("dense", "experts"))
            assert abs(kept - (1 - fraction) * state) <= 2
            host = after.term("optimizer: offloaded to host")
            assert not host.on_gpu and host.exact == (fraction == 1.0)
            # per element on the host: fp32 master, m, v (12 B, as on the GPU) + a grad copy
            assert abs(host.nbytes - fraction * state * 16 / 12) <= 16
            assert before.gpu_bytes - after.gpu_bytes == state - kept
    # 235B on 32 GPUs: only with the optimizer state offloaded, and only because the trainer's
    # finiteness check runs in chunks (`backend.grad_check`): over a whole 7.2G-element expert
    # grad buffer at once it held 7 B per element (47 GiB) at the optimizer step (issue 22)
    assert not base.fits
    full = PlanOptions(micro_batch_tokens=18432, optimizer_offload_fraction=1.0)
    assert plan_memory(config, layout, full).fits
    whole = dataclasses.replace(full, grad_check_chunk_elements=None)
    assert not plan_memory(config, layout, whole).fits
    assert plan_memory(config, layout, whole).peak.peak_phase.name == PHASE_GRAD_CHECK
    with pytest.raises(ValueError, match="needs distributed_optimizer"):
        PlanOptions(distributed_optimizer=False, optimizer_offload_fraction=0.5)
    with pytest.raises(ValueError, match="must be in"):
        PlanOptions(optimizer_offload_fraction=1.5)


# ------------------------------------------------------------------------- routing, activations
@pytest.mark.parametrize("codec_name", ["uint8", "packed"])
def test_routing_state_reuses_the_routing_memory_accounting(codec_name):
    config = load_model_config("qwen3-30b-a3b")
    layout = _layout(16, tensor_parallel=2, expert_parallel=8)
    options = PlanOptions(
        routing_replay="r2",
        routing_codec=codec_name,
        routing_responses=512,
        routing_response_tokens=18432,
        micro_batch_tokens=18432,
    )
    stage = plan_memory(config, layout, options).stages[0]
    codec = RoutingCodec(128, 8, codec_name)
    expected = routing_state_bytes(codec, 512, 18432, 48, layout.parallel, 8)
    assert stage.term("routing state").nbytes == expected
    assert stage.term("routing state").on_gpu
    assert stage.term("routing targets").nbytes == 9216 * 48 * 8 * 8  # int64 [t, topk] per layer
    options = PlanOptions(routing_replay="r3", routing_codec=codec_name, routing_tokens=1000)
    r3 = plan_memory(config, layout, options).stages[0].term("routing state")
    assert not r3.on_gpu  # R3 routes travel with the samples, on the host
    assert r3.nbytes == codec.nbytes(1000, 48)


def test_activation_estimate_formula_and_recompute():
    config = load_model_config("qwen3-30b-a3b")
    layout = _layout(16, tensor_parallel=2, expert_parallel=8)
    options = PlanOptions(micro_batch_tokens=18432)
    shape = ModelShape.from_hf(config)
    terms = layer_activation_bytes(shape, layout, options, moe=True)
    s, t, a = 18432, 9216, 2
    q, kv = 32 * D // 2, 4 * D // 2
    assert terms["norms"] == 4 * t * H * a
    # QKV out + q/k-norm out + rotated q, k and v + attention out + fp32 log-sum-exp
    qkv, qk, attn_in, out = (q + 2 * kv), (q + kv), (q + 2 * kv), q
    assert terms["attention"] == s * a * (qkv + qk + attn_in + out) + 4 * s * 16
    assert terms["router"] == 4 * t * (H + 2 * E)
    assert terms["experts"] == t * 8 * (2 * H + 3 * F_MOE) * a
    layer = sum(terms.values())
    # the stored activations are a timeline now (issue 22): at the end of the forward, the
    # layer inputs (full recompute) or every layer (none), + the final norm; a recomputed layer's
    # backward adds that layer's activations. The old single "activations" term was the sum.
    params = stage_params(shape, layout, 0)
    full = stored_activations(shape, layout, options, params)
    assert full.end == 48 * t * H * a + 2 * t * H * a
    assert full.recomputed == full.end + layer
    none_options = PlanOptions(micro_batch_tokens=18432, recompute="none")
    none = stored_activations(shape, layout, none_options, params)
    assert none.end == 48 * layer + 2 * t * H * a
    assert none.recomputed == 0
    # at the last layer's attention its MLP part is not stored (yet / any more), nor the final norm
    mlp = terms["router"] + terms["experts"]
    assert none.attention == 48 * layer - mlp
    assert not plan_memory(config, layout, none_options).fits  # 48 layers at 18k: not in 80 GiB


def test_local_spec_keeps_the_unfused_attention_matrices():
    """`layer_activation_bytes` of the local spec: the kernel keeps GQA-expanded k and v (every
    query head) and no log-sum-exp, and each layer keeps its [heads, s, s] probabilities."""
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layout = _layout(16, tensor_parallel=2, expert_parallel=8)
    te = layer_activation_bytes(shape, layout, PlanOptions(micro_batch_tokens=4096), moe=True)
    options = PlanOptions(micro_batch_tokens=4096, spec="local")
    local = layer_activation_bytes(shape, layout, options, moe=True)
    s, a, q, kv = 4096, 2, 32 * D // 2, 4 * D // 2
    assert local["attention"] - te["attention"] == s * a * (3 * q - (q + 2 * kv)) - 4 * s * 16
    assert local["attention probabilities"] == attention_bytes(shape, layout, options).saved
    assert "attention probabilities" not in te


def test_attention_terms_follow_megatrons_dot_product_attention():
    """bf16: per layer fp32 P + bf16 P + the [s, s] bool mask kept; the bf16 global scores buffer
    kept once; at a layer's softmax cast the scores and their fp32 copy on top (6 B), at its
    softmax backward P, dP and dscores in fp32 (12 B) instead of the saved 6 B. fp32 has no copy
    and no cast. TE's fused attention has no [s, s] tensor."""
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layout = _layout(2, tensor_parallel=2)
    s, n = 4096, 16  # 32 heads over TP 2
    A = 2 * n * (s // 2) ** 2  # two sequences of 2,048 tokens
    bf16 = attention_bytes(
        shape, layout, PlanOptions(micro_batch_tokens=s, micro_batch_sequences=2, spec="local")
    )
    assert (bf16.elements, bf16.saved, bf16.persistent) == (A, 6 * A + (s // 2) ** 2, 2 * A)
    assert (bf16.forward, bf16.backward, bf16.excess) == (6 * A, 6 * A, 4 * A)
    assert bf16.saved - (s // 2) ** 2 + bf16.backward == 12 * A  # three fp32 [b n, s, s]
    fp32_options = PlanOptions(params_dtype="float32", micro_batch_tokens=s, spec="local")
    fp32 = attention_bytes(shape, layout, fp32_options)
    A = n * s * s
    assert (fp32.saved, fp32.persistent, fp32.forward, fp32.backward) == (
        4 * A + s * s,
        4 * A,
        4 * A,
        8 * A,
    )
    te = attention_bytes(shape, layout, PlanOptions(micro_batch_tokens=s))
    q, kv = 32 * D // 2, 4 * D // 2
    assert (te.saved, te.persistent, te.forward, te.excess) == (0, 0, 0, 0)
    assert te.backward == s * (q + 2 * kv) * 2  # dq, dk, dv
    with pytest.raises(ValueError, match="no context parallelism"):
        plan_memory(shape, _layout(2, context_parallel=2), PlanOptions(spec="local"))


class _SquareTensorBytes(TorchDispatchMode):
    """Bytes of live storages created (not viewed) under this mode whose tensors end in ``[s, s]``:
    the attention matrices and masks; the peak before and after ``mark_backward()``."""

    def __init__(self, s: int) -> None:
        super().__init__()
        self.s, self.live, self.peaks, self.phase = s, {}, [0, 0], 0

    def mark_backward(self) -> None:
        self.phase = 1

    @property
    def nbytes(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(nbytes for _, nbytes in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.shape[-2:] == (self.s, self.s):
                    ref = StorageWeakRef(tensor.untyped_storage())
                    self.live.setdefault(ref.cdata, (ref, tensor.untyped_storage().nbytes()))
        self.peaks[self.phase] = max(self.peaks[self.phase], self.nbytes)
        return out


def test_local_attention_terms_match_a_cpu_trace_of_megatrons_code(ws1):
    """The tiny bf16 model on the local spec (megatron-core's own DotProductAttention and
    softmax): every [.., s, s] storage its forward and backward create, followed op by op, gives
    exactly `attention_bytes`'s saved / forward / backward counts. (The H200's measured excess is
    on top of these; the persistent scores buffer exists from the first, no-grad forward.)"""
    from megatron_rl.model import ModelOptions, build_model
    from megatron_rl.train.logprobs import forward_logits

    config = load_model_config("tiny")
    model = build_model(config, ModelOptions(dtype="bfloat16"), spec="local")
    s = 96  # not the vocabulary (512), hidden (64) or a head's width
    tokens = torch.randint(0, config.vocab_size, (1, s), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        forward_logits(model, tokens)  # megatron allocates its global scores buffer here
    tracker = _SquareTensorBytes(s)
    with tracker:
        logits = forward_logits(model, tokens)
        after_forward = tracker.nbytes
        tracker.mark_backward()
        logits.float().square().mean().backward()
    options = PlanOptions(micro_batch_tokens=s, spec="local")
    att = attention_bytes(ModelShape.from_hf(config), _layout(), options)
    layers = config.num_hidden_layers
    assert after_forward == layers * att.saved
    assert tracker.peaks[0] == layers * att.saved + att.forward  # the last layer's softmax cast
    assert tracker.peaks[1] == layers * att.saved + att.backward  # its softmax backward
    print("saved per layer", att.saved, "peaks", tracker.peaks)


# The H200's steady-state peaks (GiB, torch.cuda.max_memory_allocated of the second update, Adam's
# moments allocated) of the Qwen3-30B-A3B-shaped 2-layer slice that tools/gpu_smoke.py (d) runs:
# one GPU, bf16, local spec, distributed optimizer, no recompute, one sequence of 4,096 / 8,192
# tokens. From the README's H200 run (torch 2.11 + CUDA 13, megatron-core 0.16.1). The plan said
# 43.6 / 59.2 before the attention term and the timeline (issue 22).
H200_SLICE_PEAK_GIB = {4096: 44.6, 8192: 81.4}


def _slice_plan(tokens: int):
    config = load_model_config("qwen3-30b-a3b", num_hidden_layers=2)
    options = PlanOptions(
        params_dtype="bfloat16",
        distributed_optimizer=True,
        recompute="none",
        micro_batch_tokens=tokens,
        reserve_gib=0.0,
        spec="local",
        grad_check_chunk_elements=None,  # the H200 run's trainer checked whole buffers
    )
    return plan_memory(config, _layout(1), options, gpu_gib=141)


@pytest.mark.parametrize("tokens", sorted(H200_SLICE_PEAK_GIB))
def test_slice_plan_predicts_the_h200_steady_state_peak(tokens):
    measured = H200_SLICE_PEAK_GIB[tokens]
    plan = _slice_plan(tokens)
    predicted = plan.total_bytes / GIB
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)
    stage = plan.peak
    # the peak is the static terms + one phase; the logits die before the layers' backward
    phases = {phase.name: phase for phase in stage.phases}
    assert "logits" in {term.name for term in phases[PHASE_LOGPROBS].terms}
    assert "logits" not in {term.name for term in phases[PHASE_BACKWARD].terms}
    assert stage.gpu_bytes == sum(t.nbytes for t in stage.static) + stage.peak_phase.nbytes
    assert stage.peak_phase.nbytes == max(phase.nbytes for phase in stage.phases)
    if tokens == 8192:  # the [heads, s, s] matrices decide
        assert stage.peak_phase.name in (PHASE_FORWARD, PHASE_BACKWARD)
    print(tokens, f"plan {predicted:.2f} GiB at {stage.peak_phase.name}; H200 {measured} GiB")


def test_cli_reproduces_the_slice(capsys):
    tool = _load_tool()
    argv = ["--model", "qwen3-30b-a3b", "--num-layers", "2", "--spec", "local"]
    argv += ["--recompute", "none", "--reserve-gib", "0", "--gpu-gib", "141"]
    assert tool.main([*argv, "--micro-batch-tokens", "8192", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_bytes"] == _slice_plan(8192).total_bytes
    assert plan["peak_phase"] == PHASE_BACKWARD and plan["attention"]["spec"] == "local"
    assert tool.main([*argv, "--micro-batch-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    for expected in ("attention (local, unfused)", "<- peak", "FITS in 141 GiB", "needed at"):
        assert expected in out, expected


def test_step_phases_gradient_check_and_adam():
    """The trainer's isfinite over a whole fp32 grad buffer holds |x| and three bool tensors of
    its size (7 B per element); torch's AdamW (local spec) a fp32 sqrt(v) per optimizer element."""
    config = load_model_config("qwen3-30b-a3b")
    layout = _layout(16, tensor_parallel=2, expert_parallel=8)
    whole = PlanOptions(micro_batch_tokens=4096, grad_check_chunk_elements=None)
    stage = plan_memory(config, layout, whole).stages[0]
    check = {phase.name: phase for phase in stage.phases}[PHASE_GRAD_CHECK]
    assert check.nbytes == 7 * 3_623_878_656  # the expert buffer, the larger of the two
    assert PHASE_ADAM not in {phase.name for phase in stage.phases}  # TE's FusedAdam
    stage = plan_memory(config, layout, PlanOptions(micro_batch_tokens=4096)).stages[0]
    chunk = GRAD_CHECK_CHUNK_ELEMENTS  # the trainer's chunk (backend/grad_check.py)
    assert {phase.name: phase for phase in stage.phases}[PHASE_GRAD_CHECK].nbytes == 7 * chunk
    local = plan_memory(config, layout, PlanOptions(micro_batch_tokens=4096, spec="local"))
    adam = {phase.name: phase for phase in local.stages[0].phases}[PHASE_ADAM]
    elements = 776_943_616 // 8 + 3_623_878_656 // 2  # the shards of the dense and expert buffers
    assert adam.nbytes == 4 * elements


# ------------------------------------------------------------------------- validation, CLI
@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            {"tensor_parallel": 3},
            "num_attention_heads=32 is not divisible by tensor parallel size 3",
        ),
        (
            {"tensor_parallel": 8},
            "num_key_value_heads=4 is not divisible by tensor parallel size 8",
        ),
        ({"expert_parallel": 3}, "num_experts=128 is not divisible by expert parallel size 3"),
        ({"pipeline_parallel": 5}, "not divisible by pipeline parallel size 5"),
        ({"expert_parallel": 16}, "not divisible by expert-tensor"),
    ],
)
def test_invalid_layouts_raise(sizes, message):
    config = load_model_config("qwen3-30b-a3b")
    world = 8 * sizes.get("tensor_parallel", 1) * sizes.get("pipeline_parallel", 1)
    with pytest.raises(ValueError, match=message):
        plan_memory(config, _layout(world, **sizes))


def test_invalid_options_raise():
    with pytest.raises(ValueError, match="routing replay needs"):
        PlanOptions(routing_replay="r2")
    with pytest.raises(ValueError, match="recompute"):
        PlanOptions(recompute="selective")
    with pytest.raises(ValueError, match="world size 12"):
        _layout(12, tensor_parallel=8)


def _load_tool():
    spec = importlib.util.spec_from_file_location("memory_plan", ROOT / "tools/memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_table_and_error_exit(capsys):
    tool = _load_tool()
    argv = ["--model", "qwen3-30b-a3b", "--tp", "2", "--ep", "8", "--world-size", "16"]
    assert tool.main([*argv, "--micro-batch-tokens", "18432", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    for expected in ("gradient buffers", "optimizer: experts", "FITS in 80 GiB", "estimate"):
        assert expected in out, expected
    assert tool.main([*argv[:4], "--ep", "3", "--world-size", "6"]) == 2
    assert "num_experts=128 is not divisible by expert parallel size 3" in capsys.readouterr().err


def test_cli_pipeline_flags_and_offload(capsys):
    tool = _load_tool()
    argv = ["--model", "qwen3-235b-a22b", "--tp", "4", "--pp", "4", "--ep", "8"]
    argv += ["--world-size", "32", "--micro-batch-tokens", "18432", "--json"]
    uneven = ["--decoder-first-pipeline-num-layers", "23", "--decoder-last-pipeline-num-layers"]
    chunked = ["--optimizer-offload-fraction", "1", "--grad-check-chunk-elements", str(2**26)]
    assert tool.main([*argv, *uneven, "23", *chunked]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["pipeline_layers"] == [23, 24, 24, 23] and plan["fits"]
    whole = [*chunked[:3], "0"]  # the whole-buffer check (the trainer before it chunked)
    assert tool.main([*argv, *uneven, "23", *whole]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not plan["fits"] and plan["peak_phase"] == PHASE_GRAD_CHECK
    assert tool.main([*argv, "--pipeline-layers", "23,24,24,23", *chunked[2:]]) == 0
    assert not json.loads(capsys.readouterr().out)["fits"]  # no offload
    assert tool.main([*argv, *uneven, "22"]) == 2
    assert "do not split evenly" in capsys.readouterr().err
    assert tool.main([*argv, *uneven, "23", "--pipeline-layers", "23,24,24,23"]) == 2
    assert "not both" in capsys.readouterr().err
    assert tool.main([*argv[:-1], *uneven, "23", "--optimizer-offload-fraction", "1"]) == 0
    assert "host memory per GPU of this stage" in capsys.readouterr().out


def test_cli_json_smoke():
    result = subprocess.run(
        [
            sys.executable,
            "tools/memory_plan.py",
            "--model",
            "tiny",
            "--world-size",
            "2",
            "--ep",
            "2",
            "--dtype",
            "fp32",
            "--routing-replay",
            "r2",
            "--routing-tokens",
            "100",
            "--reference",
            "cpu",
            "--gpu-gib",
            "1",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["model"]["total_params"] == 189_824  # the tiny model's parameter count
    assert plan["layout"]["expert_data_parallel"] == 1
    stage = plan["stages"][0]
    terms = {term["name"]: term for term in stage["terms"]}
    assert terms["parameters: experts"]["bytes"] == 2 * 4 * 6144 * 4  # 2 layers x 4 experts
    assert not terms["reference model"]["on_gpu"]
    assert plan["total_bytes"] == sum(t["bytes"] for t in stage["terms"] if t["on_gpu"])
    assert plan["fits"] is (plan["total_bytes"] <= GIB)
