"""Low-rank adapters on megatron's tensor-parallel linear layers (LoRA, Hu et al. 2021).

A frozen base layer ``y = W x`` gains ``Delta W = (alpha / r) B A`` with ``A`` ``[r, in]`` and
``B`` ``[out, r]`` trained (``B`` starts at 0, so the adapted model starts as the base):

    ``y = W x + (alpha / r) B A dropout(x)``

Each adapter keeps its base layer's collective pattern:

- **column-parallel** (``W`` split by output rows, ``W_i`` ``[out / tp, in]``): ``B`` is split
  the same way (``B_i`` ``[out / tp, r]``) and ``A`` is whole on every rank. ``u = A x`` is the
  same on every rank; ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce
  backward) gives each rank the full ``dL/du = sum_i B_i^T g_i``, so ``A``'s gradient is whole and
  equal on every rank (no further reduction) and so is the input's. Under sequence parallelism
  the input is this rank's sequence chunk: ``u`` is all-gathered over the sequence (``r``
  columns, not ``in``) and ``A``'s gradient, from this chunk only, is summed over the
  tensor-parallel group by megatron's ``finalize_model_grads`` (``A`` is marked
  ``sequence_parallel``, as the norms are).
- **row-parallel** (``W`` split by input columns, ``W_i`` ``[out, in / tp]``): ``A`` is split the
  same way (``A_i`` ``[r, in / tp]``) and ``B`` is whole. ``u = sum_i A_i x_i`` is all-reduced
  (reduce-scattered over the sequence under sequence parallelism, where ``B`` is marked
  ``sequence_parallel``), so ``B u`` matches the base layer's output layout.

Initialisation is independent of the layout: the whole ``A`` is drawn from a generator seeded by
the run's seed and the layer's name (PEFT's default, Kaiming-uniform with ``a = sqrt(5)``), and
each rank keeps its shard. Dropout (on the adapter's input only) draws from torch's default
generator, as megatron's own hidden dropout outside sequence-parallel regions does: megatron
seeds it alike on the tensor-parallel ranks, whose whole inputs to a column-parallel layer are
equal, so their masks are too, and its activation recompute restores that generator's state. At
tensor parallelism > 1 it is refused where a rank holds only part of the input (a row-parallel
layer, or any layer under sequence parallelism): one mask over the whole input would need the
other ranks' draws.
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

COLUMN, ROW = "column", "row"


def layout_independent_a(name: str, seed: int, rank: int, in_features: int) -> torch.Tensor:
    """float32 ``[r, in]``: PEFT's Kaiming-uniform ``A`` (bound ``1 / sqrt(in)``) drawn from a
    generator seeded by ``seed`` and ``name``: the same whole matrix at every layout."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a = sqrt(5)) on [r, in]
    return (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound


class LoRALinear(torch.nn.Module):
    """A megatron ``ColumnParallelLinear`` or ``RowParallelLinear`` (``base``, frozen) with a
    trained low-rank update; ``forward`` returns what ``base`` does, ``(output, bias)``.

    ``kind``: ``"column"`` or ``"row"``; ``name``: the layer's parameter prefix (seeds ``A``);
    ``sequence_parallel``: the base layer's setting. Adapter parameters: ``lora_A`` ``[r, in]``
    (``[r, in / tp]`` for a row layer) and ``lora_B`` ``[out / tp, r]`` (``[out, r]``)."""

    def __init__(
        self,
        base: torch.nn.Module,
        kind: str,
        *,
        name: str,
        rank: int,
        alpha: float,
        dropout: float,
        seed: int,
        sequence_parallel: bool,
    ):
        super().__init__()
        if kind not in (COLUMN, ROW):
            raise ValueError(f"kind={kind!r}: must be {COLUMN!r} or {ROW!r}")
        self.base, self.kind, self.name = base, kind, name
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.sequence_parallel = sequence_parallel
        self.seed = seed
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        if dropout and tp > 1 and (kind == ROW or sequence_parallel):
            raise ValueError(
                f"{name}: --lora-dropout needs one mask over the layer's whole input, which no "
                "rank holds here (a row-parallel layer or sequence parallelism at tensor "
                "parallelism > 1); use --lora-dropout 0"
            )
        self.dropout = dropout
        for p in base.parameters():
            p.requires_grad_(False)
        weight = base.weight
        out_local, in_local = weight.shape
        in_full = in_local * tp if kind == ROW else in_local
        full_a = layout_independent_a(name, seed, rank, in_full)
        if kind == ROW:
            full_a = full_a[:, tp_rank * in_local : (tp_rank + 1) * in_local]
        self.lora_A = torch.nn.Parameter(full_a.to(weight.device, weight.dtype).contiguous())
        self.lora_B = torch.nn.Parameter(
            torch.zeros(out_local, rank, device=weight.device, dtype=weight.dtype)
        )
        # megatron's attributes: a column layer's B and a row layer's A are split over TP
        split = self.lora_B if kind == COLUMN else self.lora_A
        split.tensor_model_parallel = True
        split.partition_dim = 0 if kind == COLUMN else 1
        split.partition_stride = 1
        whole = self.lora_A if kind == COLUMN else self.lora_B
        whole.tensor_model_parallel = False
        whole.sequence_parallel = bool(sequence_parallel and tp > 1)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        return out + self.delta(x).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``(alpha / r) B A dropout(x)`` in the base output's layout."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, self.dropout)
        u = torch.nn.functional.linear(x, self.lora_A)
        if self.kind == COLUMN:
            if tp > 1:
                if self.sequence_parallel:
                    u = gather_from_sequence_parallel_region(u)
                else:
                    u = copy_to_tensor_model_parallel_region(u)
        elif tp > 1:
            if self.sequence_parallel:
                u = reduce_scatter_to_sequence_parallel_region(u)
            else:
                u = reduce_from_tensor_model_parallel_region(u)
        return torch.nn.functional.linear(u, self.lora_B) * self.scale

    def merged_state(self) -> dict[str, torch.Tensor]:
        """The unadapted layer's state-dict entries that differ: ``{"weight": merged}``."""
        return {"weight": self.merged_weight()}

    merged_entries = merged_state  # its conversion entries: the same single weight

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + (alpha / r) B A`` (detached), the base weight's layout."""
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
            return (self.base.weight.float() + delta).to(self.base.weight.dtype)
