"""The MoE all-to-all dispatcher's chunk sort as one gather (megatron-core without TE).

``MoEAlltoAllTokenDispatcher`` reorders its tokens twice per MoE layer and call, from
``[rank, local expert]`` to ``[local expert, rank]`` chunks after dispatch and back before
combine (``moe_utils.sort_chunks_by_idxs``). Without Transformer Engine's fused kernel megatron
splits the ``[N, h]`` tokens (and their ``[N]`` probs) into one view per chunk and concatenates
them in the sorted order: with 64 local experts, 64 views and a 64-way ``cat`` in the forward,
and the same again as ``SplitBackward`` / ``CatBackward`` in the backward. `sort_chunks_by_index`
computes the same permutation as one ``index_select``: output row ``p`` of sorted chunk ``k`` is
input row ``start[order[k]] + (p - out_start[k])``. Where the order is the identity (TP x EP = 1:
every chunk is one local expert, already in place) it returns its inputs as they are, as
megatron's own drop-and-pad path does (its ``view``/``transpose``/``contiguous`` of one rank is
the same storage).

Bitwise the unfused result: a gather copies rows, and its backward adds each row's gradient
into zeros exactly once (the index is a permutation). The fused path (``fused=True``, TE) is
megatron's own.
"""

from __future__ import annotations

import importlib

import torch
from megatron.core.transformer.moe import moe_utils

TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def sort_chunks_by_index(
    input: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_idxs: torch.Tensor,
    probs: torch.Tensor | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``moe_utils.sort_chunks_by_idxs`` with the same arguments and results.

    ``input`` ``[N, ...]`` is chunks of ``split_sizes`` ``[C]`` rows (summing to N); the result
    is the chunks in the order ``sorted_idxs`` ``[C]`` (and ``probs`` ``[N]`` likewise)."""
    if fused:
        return moe_utils.sort_chunks_by_idxs(
            input, split_sizes, sorted_idxs, probs=probs, fused=True
        )
    order = sorted_idxs.tolist()
    if order == list(range(len(order))):
        return input, probs
    index = chunk_gather_index(split_sizes, sorted_idxs, input.shape[0]).to(input.device)
    output = input.index_select(0, index)
    return output, (probs.index_select(0, index) if probs is not None else None)


def chunk_gather_index(split_sizes: torch.Tensor, sorted_idxs: torch.Tensor, rows: int):
    """``[N]`` int64: the input row of each output row when the chunks of ``split_sizes`` are
    laid out in the order ``sorted_idxs``."""
    sizes = split_sizes.to("cpu", torch.int64)
    order = sorted_idxs.to("cpu", torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes  # where each chunk begins in the input
    sorted_sizes = sizes[order]
    out_starts = torch.cumsum(sorted_sizes, 0) - sorted_sizes  # ... and in the output
    shift = torch.repeat_interleave(starts[order] - out_starts, sorted_sizes, output_size=rows)
    return torch.arange(rows, dtype=torch.int64) + shift


def use_gather_chunk_sort() -> None:
    """Make the all-to-all dispatcher call `sort_chunks_by_index` (idempotent; process-wide:
    every megatron model built without TE in this process)."""
    dispatcher = importlib.import_module(TOKEN_DISPATCHER)
    dispatcher.sort_chunks_by_idxs = sort_chunks_by_index
