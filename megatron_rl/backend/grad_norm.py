"""megatron's global gradient norm, clipping and a finite check, without its per-tensor loops.

What megatron-core's ``ChainedOptimizer.step`` computes between ``prepare_grads`` and
``step_with_ready_grads`` (0.16.1: ``optimizer/optimizer.py``, ``optimizer/clip_grads.py``), for
its sub-optimizers ``i`` (dense, experts)::

    sq_i  = sum over g in grads_for_norm(i) of ||g||_2^2    fp32, summed over i's group
    norm  = sqrt(sum_i sq_i)            one reduction when every i shares its group (or one i)
          = sqrt(sum_i norm_i^2)        else, norm_i = sqrt(sq_i), each reduced over its group
    g    *= clip_grad / (norm + 1e-6)   every grad an optimizer steps on, when the factor < 1

The group is the grad-stats group: the model-parallel group (TP x PP; TP x EP x PP for the
experts) for the plain optimizers, the distributed-optimizer instance (all ranks) for the
distributed one. ``grads_for_norm`` counts each gradient once: it leaves out parameters marked
``shared`` and tensor-parallel duplicates (a parameter that is not tensor-parallel, on a TP rank
other than 0). Without TE/apex megatron runs one ``torch.norm`` per tensor, then one scale per
tensor, in Python loops.

Those grads are views of megatron DDP's fp32 grad buffers (``main_grad``, or the distributed
optimizer's shards of it), at fixed places for the optimizer's life. `GradNormPlan` reads
megatron's own lists once, on the first step, and keeps views of them:

- the norm runs ``torch._foreach_norm`` over megatron's ``grads_for_norm`` in megatron's order
  (one C++ loop instead of a Python one) and then the norm of those norms, as megatron does:
  bitwise megatron's norm, so the trajectory does not depend on the buffer layout (a norm over
  whole buffers or fixed chunks of them sums in another order, and that order changes with the
  pipeline split: 1e-7 relative, enough to move pipeline-vs-single-stage metrics past 1e-7);
- clipping scales the grads merged into spans of the buffers (`merge_adjacent`: the views that
  sit end to end become one; with TP=1 one span per buffer, per padded parameter run for the
  distributed optimizer): bitwise megatron's per-tensor scale.

Finite check, folded into the norm: grads the norm leaves out are normed as well, and 0 x their
norm is added to the local square: exactly 0 when they are finite, NaN otherwise. A non-finite
total norm therefore means a non-finite gradient somewhere, and the total is the same on every
rank: each square is reduced over its group, and ranks outside it hold the same reduced values
(data-parallel replicas after the gradient all-reduce; the distributed optimizer's group is all
ranks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


def merge_adjacent(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """1-D views covering exactly the elements of ``tensors``, each run of contiguous tensors
    that sit end to end in one storage (same dtype) merged into one view.

    Sorted by storage and offset; empty tensors are dropped; a non-contiguous tensor, or one
    overlapping the previous (an alias), stays a span of its own, so every element counts as
    often as in ``tensors``.
    """
    spans: list[torch.Tensor] = []
    run: list[torch.Tensor] = []  # [first tensor of the run] while a run is open
    start = end = 0

    def close() -> None:
        if run:
            spans.append(run[0].as_strided((end - start,), (1,), start))
            run.clear()

    def key(t: torch.Tensor) -> tuple[int, int]:
        return t.untyped_storage().data_ptr(), t.storage_offset()

    for tensor in sorted((t for t in tensors if t.numel()), key=key):
        if not tensor.is_contiguous():
            close()
            spans.append(tensor)
            continue
        offset = tensor.storage_offset()
        joins = (
            run
            and offset == end
            and tensor.dtype == run[0].dtype
            and tensor.untyped_storage().data_ptr() == run[0].untyped_storage().data_ptr()
        )
        if not joins:
            close()
            run.append(tensor)
            start = offset
        end = offset + tensor.numel()
    close()
    return spans


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpans:
    """One megatron sub-optimizer's grads as views (see the module docstring)."""

    counted: list[torch.Tensor]  # megatron's grads_for_norm, one view each, in its order
    unnormed: list[torch.Tensor]  # its other grads (shared, TP duplicates) as spans: checked
    clip: list[torch.Tensor]  # every grad it steps on, as spans
    group: dist.ProcessGroup | None  # its grad-stats group
    clip_grad: float  # megatron's config.clip_grad; 0: no clipping


def local_square(counted: list[torch.Tensor], unnormed: list[torch.Tensor]) -> torch.Tensor:
    """fp32 ``[1]``: megatron's ``norm(per-tensor norms of counted) ** 2``, plus 0 x the norm of
    ``unnormed`` (NaN when those are not finite)."""
    norms = torch._foreach_norm(counted + unnormed) if counted or unnormed else []
    if counted:
        square = torch.linalg.vector_norm(torch.stack(norms[: len(counted)])).reshape(1) ** 2
    else:
        square = torch.zeros(1, dtype=torch.float32)
    if unnormed:
        square = square + 0.0 * torch.stack(norms[len(counted) :]).sum()
    return square


class GradNormPlan:
    """megatron's global grad norm and clipping for one ``ChainedOptimizer`` (see the module
    docstring). Build it with `GradNormPlan.build` after ``prepare_grads()``."""

    def __init__(self, parts: list[OptimizerSpans], shared_group: bool) -> None:
        self.parts = parts
        self.shared_group = shared_group

    @classmethod
    def build(cls, chained) -> GradNormPlan:
        """The plan for megatron's ``ChainedOptimizer`` ``chained``, whose ``prepare_grads()``
        has run (its grads are set). RuntimeError for a grad that is not fp32 (megatron's
        clipping asserts fp32: DDP must reduce in fp32)."""
        parts = []
        for optimizer in chained.chained_optimizers:
            params = optimizer.get_parameters()
            grads = [p.grad for p in params if p.grad is not None]
            dtypes = {g.dtype for g in grads} - {torch.float32}
            if dtypes:
                raise RuntimeError(
                    f"megatron's optimizer holds {sorted(map(str, dtypes))} gradients; the "
                    "buffer-level grad norm needs fp32 (wrap the model with grad_reduce_in_fp32)"
                )
            counted = optimizer.get_main_grads_for_grad_norm() if params else []
            counted_ids = {id(g) for g in counted}
            stub = getattr(optimizer, "is_stub_optimizer", False) or not params
            unnormed = [g for g in grads if id(g) not in counted_ids]
            parts.append(
                OptimizerSpans(
                    counted=[
                        g.as_strided(g.shape, g.stride(), g.storage_offset()) for g in counted
                    ],
                    unnormed=merge_adjacent(unnormed),
                    clip=[] if stub else merge_adjacent(grads),
                    group=optimizer.get_grad_stats_parallel_group(),
                    clip_grad=optimizer.config.clip_grad,
                )
            )
        shared = len(parts) <= 1 or chained.grads_states_parallel_group_is_shared()
        return cls(parts, shared)

    def norm(self) -> float:
        """The global L2 norm of the gradients, bitwise megatron's (its groups, its order); NaN
        or inf when any gradient the optimizers step on is non-finite on any rank. Collective
        over the grad-stats groups."""
        if self.shared_group:  # megatron: one norm over the concatenated lists
            square = local_square(
                [g for part in self.parts for g in part.counted],
                [g for part in self.parts for g in part.unnormed],
            )
            _sum_over(square, self.parts[0].group if self.parts else None)
            return square.item() ** 0.5
        norms = []
        for part in self.parts:
            square = local_square(part.counted, part.unnormed)
            _sum_over(square, part.group)
            norms.append(square.item() ** 0.5)
        return math.sqrt(sum(n**2 for n in norms))

    def clip_(self, total_norm: float) -> None:
        """Scale every grad by ``clip_grad / (total_norm + 1e-6)`` when that is below 1, per
        sub-optimizer with clipping on (megatron's ``clip_grad_by_total_norm_fp32``)."""
        for part in self.parts:
            if part.clip_grad <= 0.0 or not part.clip:
                continue
            coeff = part.clip_grad / (total_norm + 1.0e-6)
            if coeff < 1.0:
                torch._foreach_mul_(part.clip, coeff)


def _sum_over(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """In-place sum of ``tensor`` over ``group`` (nothing to do for a group of one rank)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
