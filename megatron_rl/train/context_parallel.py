"""Context parallelism for the losses: every CP rank evaluates the objective on whole sequences.

Megatron shards a micro-batch's sequence dimension over the context-parallel group in ``2 cp``
chunks, rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r`` so that causal attention costs the
same on every rank (`shard_sequence` calls megatron-core's own ``get_batch_on_this_cp_rank``);
Transformer Engine's attention exchanges keys and values between the ranks (CUDA only). The
losses need whole sequences: GSPO's length-normalised sequence ratio, VESPO's sequence weights,
EPIC's prefix sums of log-ratios and every ``seq-mean-*`` aggregation.

`gather_sequence` rebuilds a ``[b, T]`` per-token tensor from every rank's ``[b, T / cp]``
shard. Its backward hands each rank the gradient at its own positions only, so every CP rank
computes the unchanged objective ``L(full)`` and ``dL/d local_r = (dL/d full)[positions of r]``;
the parameter gradients summed over the CP group are the full gradient. Megatron's DDP averages
gradients over the data x context parallel ranks, so the loss is scaled by ``dp * cp``
(`loss_scale`). Cost: one all-gather of ``b x T`` values per per-token tensor, small next to
the activations. Exact, no approximation: tested on CPU with gloo for every registered loss
(values and gradients equal the unsharded objective).

Not wired into the trainer yet: `TrainConfig` still refuses ``--context-parallel-size > 1``
(TE's context-parallel attention is CUDA only, and micro-batches must be padded to a multiple
of ``2 cp`` with labels sharded alongside the tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_sequence(
    tensors: dict[str, torch.Tensor | None], cp_group: dist.ProcessGroup
) -> dict[str, torch.Tensor | None]:
    """This rank's share of ``[b, T, ...]`` tensors (megatron's load-balanced ``2 cp`` chunks).

    Raises:
        ValueError: a sequence length is not a multiple of ``2 cp`` (pad the micro-batch).
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp = dist.get_world_size(cp_group)
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape[1] % (2 * cp):
            raise ValueError(
                f"{name}: sequence length {tensor.shape[1]} is not a multiple of 2 x "
                f"context_parallel_size = {2 * cp}; pad micro-batches to a multiple of it"
            )
    return get_batch_on_this_cp_rank(dict(tensors), cp_group=cp_group)


def gather_sequence(local_BT: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """``[b, T]`` from every rank's ``[b, T / cp]`` shard, differentiable (see module doc)."""
    if dist.get_world_size(cp_group) == 1:
        return local_BT
    return _GatherSequence.apply(local_BT, cp_group)


def loss_scale(dp: int, cp: int) -> int:
    """Factor on each rank's loss so that DDP's mean over ``dp * cp`` ranks gives the gradient
    of the full-batch objective (every CP rank holds the whole objective of its micro-batch)."""
    return dp * cp


def _chunk_order(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_BT: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
        cp, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        ctx.cp, ctx.rank = cp, rank
        local = local_BT.contiguous()
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local, group=cp_group)
        b, width = local.shape[0], local.shape[1] // 2
        full = local.new_empty(b, 2 * cp, width, *local.shape[2:])
        for r, part in enumerate(parts):
            halves = part.view(b, 2, width, *local.shape[2:])
            for half, chunk in enumerate(_chunk_order(cp, r)):
                full[:, chunk] = halves[:, half]
        return full.view(b, 2 * cp * width, *local.shape[2:])

    @staticmethod
    def backward(ctx, grad_BT: torch.Tensor):
        b, cp = grad_BT.shape[0], ctx.cp
        chunks = grad_BT.reshape(b, 2 * cp, grad_BT.shape[1] // (2 * cp), *grad_BT.shape[2:])
        own = chunks[:, list(_chunk_order(cp, ctx.rank))]
        return own.reshape(b, -1, *grad_BT.shape[2:]), None
