"""The plan's counted terms at Qwen3 sizes: total parameters against a meta-device HF model,
hand-computed per-rank splits of Qwen3-30B-A3B, pipeline splits, optimizer CPU offload, and the
routing state against `megatron_rl.routing.memory`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from memory_plan_testing import ATTN, EXPERT, NORMS, ROUTER, H, V, make_layout

from megatron_rl.memory_plan import (
    PHASE_GRAD_CHECK,
    Layout,
    ModelShape,
    PlanOptions,
    grad_buffers,
    load_model_config,
    optimizer_state_bytes,
    plan_memory,
    stage_params,
)
from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing import RoutingCodec, routing_state_bytes


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
    layout = make_layout(64, tensor_parallel=4, pipeline_parallel=2, expert_parallel=16)
    shards = sum(stage_params(shape, layout, s).expert for s in range(2))
    assert shards * 16 == shape.num_layers * shape.num_experts * shape.expert_params()


def test_qwen3_30b_total_and_active_by_hand():
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layer = ATTN + NORMS + ROUTER
    assert shape.total_params() == 48 * (layer + 128 * EXPERT) + 2 * V * H + H == 30_532_122_624
    assert shape.total_params(active=True) == 48 * (layer + 8 * EXPERT) + 2 * V * H + H


def test_per_rank_split_of_the_launcher_layout_tp2_ep8_dp8():
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layout = make_layout(16, tensor_parallel=2, expert_parallel=8)
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
    layout = make_layout(64, tensor_parallel=4, pipeline_parallel=4, expert_parallel=16)
    stages = [stage_params(shape, layout, s) for s in range(4)]
    body = 12 * (NORMS + ATTN // 4 + ROUTER)
    assert [s.dense for s in stages] == [
        V * H // 4 + body,  # embedding on the first stage
        body,
        body,
        body + H + V * H // 4,  # final norm + output layer on the last
    ]
    assert all(s.expert == 12 * 8 * EXPERT for s in stages)

    layout = make_layout(16, tensor_parallel=2, expert_parallel=4, expert_tensor_parallel=2)
    params = stage_params(shape, layout, 0)
    assert params.expert == 48 * 32 * EXPERT // 2
    assert layout.expert_data_parallel == 2

    # EP 1: megatron keeps experts in the dense buffers, sharded over DP like dense params
    layout = make_layout(8, tensor_parallel=2)
    params = stage_params(shape, layout, 0)
    buffers = grad_buffers(shape, layout, 0, distributed_optimizer=True)
    assert len(buffers) == 1 and buffers[0].group_size == 4
    assert sum(optimizer_state_bytes(buffers, PlanOptions())) == 12 * params.total // 4


def test_tied_embeddings_keep_a_copy_on_the_last_pipeline_stage():
    config = load_model_config("tiny-dense-tied")
    shape = ModelShape.from_hf(config)
    one = stage_params(shape, make_layout(), 0)
    two = [stage_params(shape, make_layout(2, pipeline_parallel=2), s) for s in range(2)]
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


@pytest.mark.parametrize("codec_name", ["uint8", "packed"])
def test_routing_state_reuses_the_routing_memory_accounting(codec_name):
    config = load_model_config("qwen3-30b-a3b")
    layout = make_layout(16, tensor_parallel=2, expert_parallel=8)
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
