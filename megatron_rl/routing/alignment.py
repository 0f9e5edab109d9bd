"""Which sample position each routed token of a Megatron micro-batch comes from (pure torch).

A MoE router sees this rank's tokens of a micro-batch as rows ``[num_local_tokens, topk]``. Routing
replay must hand it, row by row, the route recorded for the same token. ``local_token_sources``
gives, for every local row, the sample (within the micro-batch) and position it holds, following
megatron-core's layout:

* padded micro-batch ``[b, s]``: the model runs ``[s, b]``, so row ``= s_idx * b + b_idx``;
* packed (THD) micro-batch: ``b = 1``, sequences back to back, each occupying its padded slot
  ``cu_seqlens_padded[i] : cu_seqlens_padded[i + 1]`` (positions beyond its length are padding);
* context parallelism: each sequence (padded layout: the whole ``s`` axis) is cut into
  ``2 * cp`` equal chunks and CP rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r`` (megatron's
  load-balanced split, and Transformer Engine's per-sequence THD split);
* sequence parallelism: the remaining sequence axis is scattered in ``tp`` contiguous chunks.

``gather_routes`` then builds the per-layer replay tensors from per-sample routes. Rows for padding
tokens get ``pad_route`` (experts ``0..K-1``): the router still routes padding, its output never
reaches the loss.

R3 rows: a rollout engine returns routes for the positions it *processed*: prompt and response
tokens except the final token, which is sampled but never fed back, so a sample of ``n`` tokens
has ``n - 1`` rows. The trainer's forward also processes the final token; its output is unused
(no next token to score), and the trainer replays the route of the position before it there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenSources:
    """For each local router row: sample index and position (both -1 for padding)."""

    sample_R: torch.Tensor  # int64 [rows]
    position_R: torch.Tensor  # int64 [rows]

    @property
    def num_rows(self) -> int:
        return self.sample_R.numel()


def _cp_chunk_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices kept by CP rank ``cp_rank`` of an axis of ``length`` (divisible by ``2 cp``)."""
    if length % (2 * cp_size):
        raise ValueError(
            f"with context parallelism {cp_size}, each sequence axis must be divisible by "
            f"2 * cp = {2 * cp_size}; got length {length} (pad the micro-batch)"
        )
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


def _sp_chunk(length: int, tp_size: int, tp_rank: int) -> slice:
    if length % tp_size:
        raise ValueError(
            f"with sequence parallelism over {tp_size} ranks the local sequence axis must be "
            f"divisible by {tp_size}; got {length} (pad the micro-batch)"
        )
    chunk = length // tp_size
    return slice(tp_rank * chunk, (tp_rank + 1) * chunk)


def _check_ranks(tp_size: int, tp_rank: int, cp_size: int, cp_rank: int) -> None:
    if not (tp_size >= 1 and 0 <= tp_rank < tp_size and cp_size >= 1 and 0 <= cp_rank < cp_size):
        raise ValueError(
            f"invalid ranks: tp_rank={tp_rank} of {tp_size}, cp_rank={cp_rank} of {cp_size}"
        )


def local_token_sources(
    lengths: list[int],
    *,
    seq_len: int | None = None,
    cu_seqlens_padded: list[int] | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> TokenSources:
    """Sources of this rank's router rows for a padded (``seq_len``) or packed micro-batch.

    Args:
        lengths: tokens of each sample in the micro-batch (prompt + response).
        seq_len: padded layout: the micro-batch width ``s`` (>= every length).
        cu_seqlens_padded: packed layout: ``[S + 1]`` slot boundaries (slot i >= lengths[i]).
    """
    _check_ranks(tp_size, tp_rank, cp_size, cp_rank)
    lengths_t = torch.as_tensor(lengths, dtype=torch.int64)
    if (seq_len is None) == (cu_seqlens_padded is None):
        raise ValueError("pass exactly one of seq_len (padded) and cu_seqlens_padded (packed)")
    if seq_len is not None:
        if lengths_t.numel() and int(lengths_t.max()) > seq_len:
            raise ValueError(f"a sample is longer ({int(lengths_t.max())}) than seq_len={seq_len}")
        keep_S = (
            _cp_chunk_index(seq_len, cp_size, cp_rank) if cp_size > 1 else torch.arange(seq_len)
        )
        position_SB = keep_S[:, None].expand(-1, lengths_t.numel())
        sample_SB = torch.arange(lengths_t.numel()).expand(keep_S.numel(), -1)
    else:
        slots = torch.as_tensor(cu_seqlens_padded, dtype=torch.int64)
        slot_lengths = slots[1:] - slots[:-1]
        if slot_lengths.numel() != lengths_t.numel() or bool((slot_lengths < lengths_t).any()):
            raise ValueError("cu_seqlens_padded must give one slot per sample, each >= its length")
        positions, samples = [], []
        for i, slot in enumerate(slot_lengths.tolist()):
            keep = _cp_chunk_index(slot, cp_size, cp_rank) if cp_size > 1 else torch.arange(slot)
            positions.append(keep)
            samples.append(torch.full_like(keep, i))
        position_SB = torch.cat(positions)[:, None] if positions else torch.empty(0, 1).long()
        sample_SB = torch.cat(samples)[:, None] if samples else torch.empty(0, 1).long()
    if sequence_parallel and tp_size > 1:
        rows = _sp_chunk(position_SB.shape[0], tp_size, tp_rank)
        position_SB, sample_SB = position_SB[rows], sample_SB[rows]
    position_R, sample_R = position_SB.reshape(-1), sample_SB.reshape(-1)
    padding = position_R >= lengths_t[sample_R] if sample_R.numel() else position_R < 0
    minus_one = torch.full_like(position_R, -1)
    return TokenSources(
        torch.where(padding, minus_one, sample_R), torch.where(padding, minus_one, position_R)
    )


def gather_routes(
    sample_routes: list[torch.Tensor],
    lengths: list[int],
    sources: TokenSources,
    layer_columns: list[int],
    *,
    r3_rows: bool,
) -> list[torch.Tensor]:
    """Per local MoE layer, the ``[rows, K]`` int64 replay indices of this micro-batch.

    Args:
        sample_routes: per sample ``[P_i, L, K]`` decoded routes (``L`` = MoE layers they cover).
        lengths: tokens of each sample (as given to ``local_token_sources``).
        sources: ``local_token_sources`` of the micro-batch.
        layer_columns: which of the ``L`` columns each local MoE layer replays.
        r3_rows: routes come from a rollout engine (one row fewer than tokens; the final token
            replays the row before it, see the module docstring); else one row per token.
    """
    if not sample_routes or len(sample_routes) != len(lengths):
        raise ValueError(
            f"need one routes tensor per sample: {len(sample_routes)} for {len(lengths)} samples"
        )
    for i, (routes_PLK, length) in enumerate(zip(sample_routes, lengths, strict=True)):
        expected = max(length - 1, 0) if r3_rows else length
        if routes_PLK.dim() != 3 or routes_PLK.shape[0] != expected:
            raise ValueError(
                f"sample {i}: routes have shape {tuple(routes_PLK.shape)}, expected "
                f"[{expected}, moe_layers, topk] for {length} tokens"
                + (" (a rollout engine routes every token but the last)" if r3_rows else "")
            )
    topk = sample_routes[0].shape[-1]
    columns = torch.as_tensor(layer_columns, dtype=torch.int64)
    pad_route = torch.arange(topk, dtype=torch.int64)
    out_RLK = pad_route.expand(sources.num_rows, columns.numel(), topk).clone()
    for i, routes_PLK in enumerate(sample_routes):
        rows = (sources.sample_R == i).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        positions = sources.position_R[rows]
        if r3_rows:
            if routes_PLK.shape[0] == 0:
                continue  # a one-token sample: nothing was processed; keep the pad route
            positions = positions.clamp(max=routes_PLK.shape[0] - 1)
        out_RLK[rows] = routes_PLK[positions][:, columns].to(torch.int64)
    return [out_RLK[:, j].contiguous() for j in range(columns.numel())]
