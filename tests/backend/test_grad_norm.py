"""The loop-free grad norm, clipping and finite check of `PolicyOptimizer.step` against
megatron-core's own ``ChainedOptimizer.step`` (per-tensor norm and scale in Python loops): bitwise
the same norm, clipping and update, and the same skip on every rank."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_rl.backend.grad_norm import GradNormPlan, merge_adjacent
from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.model import ModelOptions, build_model, preset_config

# megatron's SequentialMLP (one parameter per expert and projection, in the expert buffers)
SEQUENTIAL = (
    {"moe_grouped_gemm": False}
    if "moe_grouped_gemm" in {f.name for f in dataclasses.fields(ModelOptions)}
    else {}
)
LAYOUTS = [
    pytest.param(distributed, dtype, id=f"{dtype}_dist{distributed}")
    for distributed in (False, True)
    for dtype in ("float32", "bfloat16")
]


# ---------------------------------------------------------------- merge_adjacent


def test_adjacent_views_merge_into_one_span_and_cover_the_same_elements():
    buffer = torch.arange(20, dtype=torch.float32)
    other = torch.arange(6, dtype=torch.float32)
    views = [buffer[4:8].view(2, 2), buffer[0:4], buffer[10:14], other[:3], buffer[8:10]]
    spans = merge_adjacent(views)
    assert [(s.untyped_storage().data_ptr(), s.storage_offset(), s.numel()) for s in spans] == (
        sorted(
            [
                (buffer.untyped_storage().data_ptr(), 0, 14),
                (other.untyped_storage().data_ptr(), 0, 3),
            ]
        )
    )
    assert sum(float(s.square().sum()) for s in spans) == sum(
        float(v.square().sum()) for v in views
    )
    torch._foreach_mul_(spans, 2.0)  # writes through to the buffers, only where the views are
    assert torch.equal(buffer[:14], 2 * torch.arange(14.0))
    assert torch.equal(buffer[14:], torch.arange(14.0, 20.0))
    assert torch.equal(other, torch.tensor([0.0, 2.0, 4.0, 3.0, 4.0, 5.0]))


def test_gaps_aliases_dtypes_and_strided_views_stay_separate():
    buffer = torch.zeros(12)
    alias = buffer[2:6]
    strided = torch.zeros(4, 4)[:, 0]
    spans = merge_adjacent([buffer[0:4], alias, buffer[8:10], strided, torch.zeros(0)])
    assert sorted(s.numel() for s in spans) == [2, 4, 4, 4]  # nothing merged, the empty dropped
    halves = torch.zeros(8).view(torch.bfloat16)  # one storage, another dtype: own spans
    assert len(merge_adjacent([buffer[0:2], halves[0:2]])) == 2


# ---------------------------------------------------------------- world size 1


def _pair(distributed: bool, dtype: str, clip_grad: float, options: dict | None = None):
    """Two copies of the tiny model (the same weights), each with its `PolicyOptimizer`."""
    models = [
        wrap_for_training(
            build_model(preset_config("tiny"), ModelOptions(dtype=dtype, **(options or {}))),
            use_distributed_optimizer=distributed,
        )
        for _ in range(2)
    ]
    models[1].module.load_state_dict(models[0].module.state_dict())
    config = OptimizerConfig(
        lr=1e-2, clip_grad=clip_grad, use_distributed_optimizer=distributed, cpu_adam="foreach"
    )  # foreach: bitwise megatron's loop (the default, fused, is within 1e-7: test_foreach_adam)
    pair = [build_optimizer(model, config) for model in models]
    assert all(torch.equal(a, b) for a, b in zip(*(_params(o) for o in pair), strict=True))
    return pair


def _params(optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in optimizer.model.parameters()]


def _buffers(optimizer):
    return optimizer.model.buffers + optimizer.model.expert_parallel_buffers


def _random_grads(optimizers, seed: int, scale: float) -> None:
    """The same random gradients in every optimizer's model (its grad buffers)."""
    for optimizer in optimizers:
        optimizer.zero_grad()
        generator = torch.Generator().manual_seed(seed)
        for buffer in _buffers(optimizer):
            buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, generator=generator))
            buffer.grad_data.mul_(scale)


def megatron_step(optimizer) -> float:
    """megatron-core's own ``ChainedOptimizer.step`` (the old path), its grad norm."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl.backend.cpu_optimizer import cuda_type_names

    finalize_model_grads([optimizer.model])
    with cuda_type_names():
        succeeded, grad_norm, _ = optimizer.inner.step()
    assert succeeded
    return grad_norm


@pytest.mark.parametrize(("distributed", "dtype"), LAYOUTS)
def test_step_is_bitwise_megatrons_without_clipping(ws1, distributed, dtype):
    ours, megatron = _pair(distributed, dtype, clip_grad=1e6, options=SEQUENTIAL)
    for step in range(4):
        _random_grads((ours, megatron), seed=step, scale=10.0 ** (step - 2))
        assert ours.step() == megatron_step(megatron)
        for a, b in zip(_params(ours), _params(megatron), strict=True):
            assert torch.equal(a, b)
    # 49 parameters in one buffer (EP=1): one span, a few where the distributed optimizer pads
    # parameter starts (to 64 elements) and buckets
    assert sum(len(part.clip) for part in ours._plan.parts) <= (5 if distributed else 1)


@pytest.mark.parametrize(("distributed", "dtype"), LAYOUTS)
def test_step_is_bitwise_megatrons_with_clipping(ws1, distributed, dtype):
    ours, megatron = _pair(distributed, dtype, clip_grad=1.0, options=SEQUENTIAL)
    for step in range(4):
        _random_grads((ours, megatron), seed=step, scale=1.0 + step)
        norm = ours.step()
        assert norm > 10.0  # clipped
        assert norm == megatron_step(megatron)
    for a, b in zip(_main_params(ours), _main_params(megatron), strict=True):
        assert torch.equal(a, b)


def _main_params(optimizer) -> list[torch.Tensor]:
    """The fp32 parameters Adam updates (megatron's master copies for bf16)."""
    return [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize(("distributed", "dtype"), LAYOUTS)
def test_given_the_same_norm_the_clipped_grads_are_megatrons_bitwise(ws1, distributed, dtype):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from megatron_rl.backend.cpu_optimizer import cuda_type_names

    ours, megatron = _pair(distributed, dtype, clip_grad=1.0, options=SEQUENTIAL)
    _random_grads((ours, megatron), seed=7, scale=1.0)
    with cuda_type_names():
        ours.inner.prepare_grads()
        megatron.inner.prepare_grads()
        plan = GradNormPlan.build(ours.inner)
        norm = plan.norm()
        plan.clip_(norm)
        for sub in megatron.inner.chained_optimizers:
            clip_grad_by_total_norm_fp32(sub.get_parameters(), 1.0, norm)
    assert norm > 10.0
    for a, b in zip(_buffers(ours), _buffers(megatron), strict=True):
        assert torch.equal(a.grad_data, b.grad_data)


def test_a_gradient_the_norm_leaves_out_is_still_checked(ws1):
    """megatron's norm skips ``shared`` parameters (and TP duplicates); a NaN there still
    skips the update, and the norm without it is still megatron's."""
    ours, megatron = _pair(False, "float32", clip_grad=1.0)
    for optimizer in (ours, megatron):
        optimizer.model.module.decoder.final_layernorm.weight.shared = True
    _random_grads((ours, megatron), seed=3, scale=1e-3)
    assert ours.step() == megatron_step(megatron)

    before = _params(ours)
    _random_grads((ours,), seed=4, scale=1e-3)
    ours.model.module.decoder.final_layernorm.weight.main_grad[3] = float("inf")
    assert ours.step() is None
    assert all(torch.equal(a, b) for a, b in zip(before, _params(ours), strict=True))
    _random_grads((ours,), seed=5, scale=1e-3)
    assert math.isfinite(ours.step())  # the next finite step goes through


# ---------------------------------------------------------------- two gloo ranks

TWO_RANK_LAYOUTS = [  # (ParallelConfig kwargs, ModelOptions kwargs, distributed optimizer, dtype)
    ({}, {}, True, "float32"),  # DP=2: the norm summed over both ranks' shards
    ({"expert_parallel": 2}, {}, False, "bfloat16"),  # dense and expert norms, each its group
    # TP duplicates (norm weights, router) that no reduction makes equal: left out on rank 1
    ({"tensor_parallel": 2}, {"sequence_parallel": False}, False, "float32"),
]


def two_rank_worker(rank, world_size, init_method, tmp_dir) -> None:
    import torch.distributed as dist

    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed

    for index, (parallel, options, distributed, dtype) in enumerate(TWO_RANK_LAYOUTS):
        init_distributed(
            ParallelConfig(**parallel),
            rank=rank,
            world_size=world_size,
            init_method=f"{init_method}{index}",
            device="cpu",
        )
        ours, megatron = _pair(distributed, dtype, 1.0, options={**SEQUENTIAL, **options})
        for step, scale in enumerate((1e-4, 1e-3, 1.0)):  # the last one is clipped
            _random_grads((ours, megatron), seed=10 * step + rank, scale=scale)
            norm = ours.step()
            assert norm == megatron_step(megatron), (parallel, step)
            norms = [None] * world_size
            dist.all_gather_object(norms, norm)
            assert norms == [norm] * world_size, (parallel, norms)
            for a, b in zip(_main_params(ours), _main_params(megatron), strict=True):
                assert torch.equal(a, b), (parallel, step)

        poisoned = [next(iter(ours.model.parameters())).main_grad]  # counted in the norm
        if parallel.get("tensor_parallel", 1) > 1:  # a TP duplicate: left out of the norm
            poisoned.append(ours.model.module.decoder.final_layernorm.weight.main_grad)
        for grad in poisoned:
            _random_grads((ours,), seed=100 + rank, scale=1e-3)
            if rank == 1:
                grad.view(-1)[0] = float("nan")
            before = _params(ours)
            assert ours.step() is None, (parallel, "rank", rank)
            assert all(torch.equal(a, b) for a, b in zip(before, _params(ours), strict=True))
        destroy_distributed()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_norm_like_megatron_and_skip_a_nan_on_one_rank_together(tmp_path):
    from qwen3_moe_testing import spawn_ranks

    spawn_ranks(two_rank_worker, tmp_path, 2)
