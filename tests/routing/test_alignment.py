"""Token alignment of routes to megatron's local router rows, against brute-force references of
megatron-core's layouts (padded [s, b], packed THD, CP load-balanced split, SP scatter)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_rl.routing import gather_routes, local_token_sources

PAD = -1


def _ids(sample: int, positions: torch.Tensor, length: int) -> torch.Tensor:
    return torch.where(positions < length, sample * 10_000 + positions, PAD)


def reference_padded(lengths, seq_len, tp, tp_rank, sp, cp, cp_rank):
    """[b, s] ids -> megatron's CP split (2cp chunks, keep r and 2cp-1-r) -> [s, b] -> SP chunk."""
    ids_BS = torch.stack([_ids(b, torch.arange(seq_len), n) for b, n in enumerate(lengths)])
    if cp > 1:
        chunks = ids_BS.view(len(lengths), 2 * cp, seq_len // (2 * cp))
        ids_BS = chunks[:, [cp_rank, 2 * cp - 1 - cp_rank]].reshape(len(lengths), -1)
    ids_SB = ids_BS.t()
    if sp:
        ids_SB = ids_SB.chunk(tp, dim=0)[tp_rank]
    return ids_SB.reshape(-1)


def reference_packed(lengths, slots, tp, tp_rank, sp, cp, cp_rank):
    """Each sample in its padded slot; TE's per-sequence CP split; SP chunk of the packed axis."""
    pieces = []
    for i, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
        ids = _ids(i, torch.arange(slot), n)
        if cp > 1:
            ids = ids.view(2 * cp, slot // (2 * cp))[[cp_rank, 2 * cp - 1 - cp_rank]].reshape(-1)
        pieces.append(ids)
    packed = torch.cat(pieces)
    return packed.chunk(tp, dim=0)[tp_rank] if sp else packed


def _as_ids(sources):
    return torch.where(sources.sample_R >= 0, sources.sample_R * 10_000 + sources.position_R, PAD)


LAYOUTS = [(tp, sp, cp) for tp, sp, cp in itertools.product([1, 2, 4], [False, True], [1, 2])]


@pytest.mark.parametrize(("tp", "sp", "cp"), LAYOUTS)
def test_padded_rows_match_megatron_layout_and_cover_every_token_once(tp, sp, cp):
    lengths, seq_len = [13, 16, 5], 16
    seen = []
    for tp_rank, cp_rank in itertools.product(range(tp), range(cp)):
        sources = local_token_sources(
            lengths,
            seq_len=seq_len,
            tp_size=tp,
            tp_rank=tp_rank,
            sequence_parallel=sp,
            cp_size=cp,
            cp_rank=cp_rank,
        )
        expected = reference_padded(lengths, seq_len, tp, tp_rank, sp, cp, cp_rank)
        assert torch.equal(_as_ids(sources), expected)
        if sp or tp_rank == 0:  # without SP every TP rank routes the same tokens
            seen.append(expected[expected >= 0])
    seen = torch.cat(seen).sort().values
    assert torch.equal(
        seen, torch.cat([b * 10_000 + torch.arange(n) for b, n in enumerate(lengths)])
    )


@pytest.mark.parametrize(("tp", "sp", "cp"), LAYOUTS)
def test_packed_rows_match_thd_layout_and_cover_every_token_once(tp, sp, cp):
    lengths = [7, 12, 3, 8]
    slots = [8, 12, 4, 8]  # each a multiple of 2 * cp = 4; total 32 divisible by tp * cp
    cu = [0, *itertools.accumulate(slots)]
    seen = []
    for tp_rank, cp_rank in itertools.product(range(tp), range(cp)):
        sources = local_token_sources(
            lengths,
            cu_seqlens_padded=cu,
            tp_size=tp,
            tp_rank=tp_rank,
            sequence_parallel=sp,
            cp_size=cp,
            cp_rank=cp_rank,
        )
        expected = reference_packed(lengths, slots, tp, tp_rank, sp, cp, cp_rank)
        assert torch.equal(_as_ids(sources), expected)
        if sp or tp_rank == 0:
            seen.append(expected[expected >= 0])
    assert torch.cat(seen).numel() == sum(lengths)
    assert torch.cat(seen).unique().numel() == sum(lengths)


def test_gather_routes_puts_each_samples_route_on_its_rows():
    lengths = [3, 2]
    routes = [
        torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 3], [4, 5]]]),
        torch.tensor([[[6, 7], [0, 1]], [[1, 3], [5, 7]]]),
    ]  # [P, L=2, K=2], one row a token
    sources = local_token_sources(lengths, seq_len=4)
    per_layer = gather_routes(routes, lengths, sources, [1, 0], r3_rows=False)
    # rows in [s, b] order: (s0,b0) (s0,b1) (s1,b0) (s1,b1) (s2,b0) (s2,pad) (s3,pad) (s3,pad)
    assert per_layer[0].tolist() == [[3, 4], [0, 1], [7, 0], [5, 7], [4, 5], [0, 1], [0, 1], [0, 1]]
    assert per_layer[1][0].tolist() == [1, 2]


def test_r3_final_token_replays_the_route_before_it():
    lengths = [3]
    engine_routes = [torch.tensor([[[1, 2]], [[3, 4]]])]  # 2 processed positions for 3 tokens
    sources = local_token_sources(lengths, seq_len=3)
    (layer,) = gather_routes(engine_routes, lengths, sources, [0], r3_rows=True)
    assert layer.tolist() == [[1, 2], [3, 4], [3, 4]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lengths=[5], seq_len=4), "longer"),
        (dict(lengths=[4], seq_len=6, cp_size=2), "divisible by 2 \\* cp = 4"),
        (dict(lengths=[4], seq_len=6, tp_size=4, sequence_parallel=True), "divisible by 4"),
        (dict(lengths=[4], seq_len=4, tp_size=2, tp_rank=2), "tp_rank=2 of 2"),
        (dict(lengths=[4, 4], cu_seqlens_padded=[0, 4]), "one slot per sample"),
        (dict(lengths=[4]), "exactly one of"),
    ],
)
def test_bad_layouts_are_value_errors(kwargs, match):
    lengths = kwargs.pop("lengths")
    with pytest.raises(ValueError, match=match):
        local_token_sources(lengths, **kwargs)


def test_routes_of_the_wrong_length_name_the_sample():
    sources = local_token_sources([3, 4], seq_len=4)
    good, bad = torch.zeros(2, 1, 2, dtype=torch.long), torch.zeros(2, 1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"sample 1: routes have shape \(2, 1, 2\), expected \[3"):
        gather_routes([good, bad], [3, 4], sources, [0], r3_rows=True)
