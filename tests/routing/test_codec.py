"""Routing codecs: round trips (property-based), exact byte counts, dtype choice, bad input."""

from __future__ import annotations

import hashlib
import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.routing.codec import RoutingCodec


def random_routes(num_tokens, num_layers, num_experts, topk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens * num_layers, num_experts, generator=gen)
    return scores.topk(topk, dim=-1).indices.reshape(num_tokens, num_layers, topk)


def same_sets(a, b):
    return torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


@pytest.mark.parametrize(
    ("num_experts", "expected"), [(2, "uint8"), (256, "uint8"), (257, "int16"), (40_000, "int32")]
)
def test_auto_picks_the_narrowest_dtype_that_holds_the_expert_ids(num_experts, expected):
    assert RoutingCodec(num_experts, 2, "auto").codec == expected


@pytest.mark.parametrize(("dtype", "num_experts"), [("uint8", 257), ("int16", 40_000)])
def test_too_narrow_dtype_is_a_value_error_at_construction(dtype, num_experts):
    with pytest.raises(ValueError, match=rf"dtype='{dtype}' holds expert ids up to"):
        RoutingCodec(num_experts, 2, dtype)


def test_bytes_per_token_layer_for_qwen3_30b_a3b():
    """128 experts, top-8: 41 bits packed, 8 B uint8, 32 B int32 (as the issue states)."""
    assert RoutingCodec(128, 8, "packed").bits == 41 == math.ceil(math.log2(math.comb(128, 8)))
    assert RoutingCodec(128, 8, "packed").bytes_per_token_layer() == 5.125
    assert RoutingCodec(128, 8, "uint8").bytes_per_token_layer() == 8
    assert RoutingCodec(128, 8, "int16").bytes_per_token_layer() == 16
    assert RoutingCodec(128, 8, "int32").bytes_per_token_layer() == 32
    assert RoutingCodec(128, 8, "packed").nbytes(1000, 48) == (1000 * 48 * 41 + 7) // 8


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32", "packed"])
def test_encoded_blob_occupies_exactly_nbytes_and_round_trips(dtype):
    codec = RoutingCodec(128, 8, dtype)
    routes = random_routes(300, 5, 128, 8)
    blob = codec.encode(routes)
    assert blob.nbytes == codec.nbytes(300, 5)
    decoded = codec.decode(blob)
    assert decoded.dtype == torch.int64 and decoded.shape == routes.shape
    if dtype == "packed":
        assert same_sets(decoded, routes)
        assert torch.equal(decoded, decoded.sort(dim=-1).values)  # canonical ascending
    else:
        assert torch.equal(decoded, routes)  # order preserved


@pytest.mark.parametrize(("num_experts", "topk"), [(60, 4), (128, 8), (512, 8), (3, 1)])
def test_packed_round_trip_across_word_boundaries(num_experts, topk):
    """Bit widths that straddle int64 words at many offsets (e.g. 41 bits for 128 top-8)."""
    codec = RoutingCodec(num_experts, topk, "packed")
    routes = random_routes(97, 3, num_experts, topk, seed=1)
    assert same_sets(codec.decode(codec.encode(routes)), routes)


@settings(max_examples=60, deadline=None)
@given(
    num_experts=st.integers(1, 300),
    data=st.data(),
    num_tokens=st.integers(0, 40),
    num_layers=st.integers(1, 4),
    dtype=st.sampled_from(["auto", "int32", "packed"]),
)
def test_round_trip_property(num_experts, data, num_tokens, num_layers, dtype):
    topk = data.draw(st.integers(1, min(num_experts, 8)))
    codec = RoutingCodec(num_experts, topk, dtype)
    routes = random_routes(num_tokens, num_layers, num_experts, topk, seed=num_experts)
    blob = codec.encode(routes)
    assert blob.nbytes == codec.nbytes(num_tokens, num_layers)
    assert same_sets(codec.decode(blob), routes)


def test_extreme_sets_pack_to_the_first_and_last_rank():
    codec = RoutingCodec(128, 8, "packed")
    routes = torch.tensor([[list(range(8))], [list(range(120, 128))]])
    assert torch.equal(codec.decode(codec.encode(routes)), routes)


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (
            torch.tensor([[[0, 130]]]),
            r"routes\[0, 0, 1\] holds expert 130, outside \[0, num_experts=128\)",
        ),
        (torch.tensor([[[3, 1]], [[-1, 2]]]), r"routes\[1, 0, 0\] holds expert -1"),
        (torch.tensor([[[5, 5]]]), r"routes\[0, 0\] repeats an expert"),
        (torch.tensor([[0, 1]]), r"must be \[tokens, moe_layers, topk=2\]"),
        (torch.tensor([[[0, 1, 2]]]), r"must be \[tokens, moe_layers, topk=2\]"),
        (torch.tensor([[[0.0, 1.0]]]), "integer torch.Tensor"),
    ],
)
def test_bad_routes_are_value_errors_naming_the_position(routes, match):
    with pytest.raises(ValueError, match=match):
        RoutingCodec(128, 2, "packed").encode(routes)


def test_decoding_with_the_wrong_codec_or_size_is_an_error():
    blob = RoutingCodec(128, 2, "uint8").encode(random_routes(4, 1, 128, 2))
    with pytest.raises(ValueError, match="encoded with 'uint8'"):
        RoutingCodec(128, 2, "int16").decode(blob)
    packed = RoutingCodec(128, 2, "packed")
    truncated = type(blob)(packed.encode(random_routes(4, 1, 128, 2)).data[:-1], "packed", 4, 1)
    with pytest.raises(ValueError, match="need"):
        packed.decode(truncated)


# sha256 of ``encode(...).data`` bytes computed with the codec before the issue-13 speed-up
# (random_routes(123, 3, E, K, seed=10 * E + K), sets in score order): the format is the contract.
GOLDEN_SHA256 = {
    (128, 8, "uint8"): "5df4435d181e4ada8292e4852f13afbbd3e07c84e9687d33ce5768cc735f5175",
    (128, 8, "int16"): "579eae2eeef742b343dc46b728b30a23f95d06f61fee8599d4b10cfadfe86148",
    (128, 8, "int32"): "d8303a1d8a3269b2a4bc9eb9db63aedd938614b4a19e5d45d43df16a0b349f18",
    (128, 8, "packed"): "510c5e7b2bed6e7999906090a0dd990222ab9410170aa8e61d04c05e96a14a88",
    (256, 8, "uint8"): "68e3dad6b393a666dc47583e428fc4aa05feb8e3fde31c110db5bb4b2d615200",
    (256, 8, "int16"): "e4b5d1935000f6388ec1b83bec599829e231044487cb6eb797d535c3cb8a3590",
    (256, 8, "int32"): "bfd244c8c0fd44bf52e5f52d3c6673de11a1ba47c603759c5d1dc67667f8322e",
    (256, 8, "packed"): "ba07b4234c0ae4440b0137479cb7e1277f1d1c7f5fa919347a83dfcd64648c0d",
    (64, 6, "uint8"): "90d7665420ddf90869c0d2cc0ce0f05d2be9b15854d5b496c6d874c5e71a59cd",
    (64, 6, "int16"): "5149b750914fefbcc4b4249f0f9cbec92abbcd3e87428545353d5ee1624bc73b",
    (64, 6, "int32"): "bed2fe2677f888ce03366effd068fa8c5ed87f86a36b4fd121355c4bbcff8125",
    (64, 6, "packed"): "09fcd9406bfcee2405b78bcadcf6d7a012a70d869001a3fe38a183b59ea4dfd6",
    (8, 2, "uint8"): "13be29169fec78b00bf3f31ab2d83b84b1805a6ea2f2508cd332b66b5e46c649",
    (8, 2, "int16"): "e8d5530f00342e9e7357136c2db0d7979d36216bf3185c1bfa90689db5d9645a",
    (8, 2, "int32"): "a4c580a1347a9bb9f0d5e901266e1e9db78ac650ec552a53010a50d1ec9bbb9c",
    (8, 2, "packed"): "71bac704dd27c1610b27d6d1ff9690394d058dd67b10b4506cc524be9a30000f",
}


@pytest.mark.parametrize(("num_experts", "topk", "dtype"), list(GOLDEN_SHA256))
def test_encoded_bytes_are_identical_to_the_frozen_format(num_experts, topk, dtype):
    routes = random_routes(123, 3, num_experts, topk, seed=10 * num_experts + topk)
    codec = RoutingCodec(num_experts, topk, dtype)
    blob = codec.encode(routes)
    digest = hashlib.sha256(blob.data.contiguous().numpy().tobytes()).hexdigest()
    assert digest == GOLDEN_SHA256[num_experts, topk, dtype]
    assert same_sets(codec.decode(blob), routes)


@pytest.mark.parametrize("topk", [*range(1, 18), 31, 32, 33])
def test_validation_sorting_network_sorts_every_column_set(topk):
    """Encode through the network must equal the rank of the fully sorted sets (K not 2^n too)."""
    num_experts = 40
    routes = random_routes(50, 2, num_experts, topk, seed=topk)
    codec = RoutingCodec(num_experts, topk, "int32")
    _, columns = codec._check(routes)
    expected = routes.reshape(-1, topk).sort(dim=-1).values
    assert torch.equal(torch.stack(columns, dim=1).long(), expected)


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32", "packed"])
@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (torch.tensor([[[0, 1, 2]], [[4, 3, 128]]]), r"routes\[1, 0, 2\] holds expert 128"),
        (torch.tensor([[[0, 1, 2]], [[4, -3, 1]]]), r"routes\[1, 0, 1\] holds expert -3"),
        (torch.tensor([[[0, 1, 2], [7, 9, 7]]]), r"routes\[0, 1\] repeats an expert.*\[7, 9, 7\]"),
        (torch.tensor([[0, 1, 2]]), r"must be \[tokens, moe_layers, topk=3\]"),
        (torch.tensor([[[0, 1]]]), r"must be \[tokens, moe_layers, topk=3\]"),
        (torch.tensor([[[0.0, 1.0, 2.0]]]), "integer torch.Tensor"),
    ],
)
def test_every_codec_keeps_every_validation_error(dtype, routes, match):
    with pytest.raises(ValueError, match=match):
        RoutingCodec(128, 3, dtype).encode(routes)


def test_corrupt_packed_rank_is_a_value_error():
    codec = RoutingCodec(128, 8, "packed")  # 41 bits hold ranks beyond C(128, 8) - 1
    blob = codec.encode(random_routes(4, 1, 128, 8))
    data = blob.data.clone()
    data[:6] = 0xFF  # first rank becomes 2^41 - 1 > C(128, 8) - 1
    with pytest.raises(ValueError, match="corrupt"):
        codec.decode(type(blob)(data, "packed", 4, 1))


def test_empty_and_single_expert_inputs():
    for dtype in ("uint8", "packed"):
        codec = RoutingCodec(16, 4, dtype)
        empty = torch.empty(0, 3, 4, dtype=torch.int64)
        assert codec.decode(codec.encode(empty)).shape == (0, 3, 4)
    one = RoutingCodec(1, 1, "packed")
    routes = torch.zeros(5, 2, 1, dtype=torch.int64)
    assert torch.equal(one.decode(one.encode(routes)), routes)


# ---------------------------------------------------------------- packed decode vs brute force
def pack_ranks(ranks, bits):
    """Independent packer: rank ``i`` at bits ``[i*bits, (i+1)*bits)`` of a little-endian int."""
    stream = sum(rank << (i * bits) for i, rank in enumerate(ranks))
    return torch.tensor(
        list(stream.to_bytes((len(ranks) * bits + 7) // 8, "little")), dtype=torch.uint8
    )


def brute_unrank(rank, num_experts, topk):
    """Greedy with Python ints: ``c_j = max{n : C(n, j) <= rem}`` by bisection on ``n``."""
    out = []
    for j in range(topk, 0, -1):
        lo, hi = j - 1, num_experts - 1  # C(j - 1, j) = 0 <= rank
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if math.comb(mid, j) <= rank else (lo, mid - 1)
        out.append(lo)
        rank -= math.comb(lo, j)
    return out[::-1]


def rank_of(ascending):
    return sum(math.comb(c, j) for j, c in enumerate(ascending, start=1))


def decode_ranks(codec, ranks, dtype=torch.int64):
    blob = type(codec.encode(torch.zeros(0, 1, codec.topk, dtype=torch.int64)))(
        pack_ranks(ranks, codec.bits), "packed", len(ranks), 1
    )
    return codec.decode(blob, dtype).reshape(len(ranks), codec.topk)


def threshold_sets(num_experts, topk):
    """For every level ``j`` and expert ``n``: the sets whose remainder at level ``j`` is exactly
    ``C(n, j)`` (lower experts ``0..j-2``) or ``C(n + 1, j) - 1`` (lower experts ``n-j+1..n-1``),
    with the top ``K - j`` experts at ``E-K+j..E-1``; includes expert 0, expert E-1, rank 0 and
    rank ``C(E, K) - 1``."""
    sets = []
    for j in range(1, topk + 1):
        top = list(range(num_experts - topk + j, num_experts))
        for n in range(j - 1, num_experts - topk + j):
            sets.append([*range(j - 1), n, *top])
            sets.append([*range(n - j + 1, n + 1), *top])
    return sets


@pytest.mark.parametrize(
    ("num_experts", "topk"), [(1, 1), (6, 1), (6, 6), (7, 3), (10, 4), (12, 2), (9, 8)]
)
def test_packed_decode_equals_colex_enumeration(num_experts, topk):
    """Exhaustive: rank r decodes to the r-th K-subset in colex order (itertools, re-sorted)."""
    colex = sorted(itertools.combinations(range(num_experts), topk), key=lambda c: c[::-1])
    codec = RoutingCodec(num_experts, topk, "packed")
    decoded = decode_ranks(codec, list(range(len(colex))))
    assert decoded.tolist() == [list(c) for c in colex]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_experts", "topk"),
    [
        (128, 8),
        (256, 8),
        (512, 8),
        (300, 8),
        (64, 6),
        (1000, 4),
        (128, 1),
        (16, 16),
        (5000, 2),
        (2500, 6),
    ],
)
def test_packed_decode_equals_brute_force_unrank(num_experts, topk):
    """Both sides of every binomial threshold at every level, plus random ranks; the numpy path
    (CPU), the torch path, and the fallbacks (no lookup table for 5000 experts, 59 bits)."""
    rng = random.Random(num_experts * 100 + topk)
    limit = math.comb(num_experts, topk)
    sets = threshold_sets(num_experts, topk)
    ranks = [rank_of(s) for s in sets] + [rng.randrange(limit) for _ in range(1000)]
    ranks = [*ranks, 0, limit - 1]
    expected = [brute_unrank(r, num_experts, topk) for r in ranks]
    assert all(brute_unrank(rank_of(s), num_experts, topk) == s for s in sets)
    codec = RoutingCodec(num_experts, topk, "packed")
    assert decode_ranks(codec, ranks).tolist() == expected
    torch_path = codec._unrank(codec._unpack(pack_ranks(ranks, codec.bits), len(ranks)))
    assert torch_path.tolist() == expected


def test_lookup_guess_needs_exactly_one_correction():
    """The table guess is ``c_j`` or ``c_j - 1``, and both occur: the correction step is live."""
    codec = RoutingCodec(128, 8, "packed")
    m, tables = codec._lookup_tables()
    low = exact = 0
    for j, (guess, binom, _) in zip(range(8, 1, -1), tables, strict=True):
        rems = sorted(
            {v + d for v in binom[j - 1 : 129].tolist() for d in (-1, 0, 1) if v + d >= 0}
        )
        rems = [r for r in rems if r < 2**41]
        floats = torch.tensor(rems, dtype=torch.float64).numpy().view("int64")
        index = ((floats >> (52 - m)) - ((1023 << m) - 1)).clip(0)
        for rem, g in zip(rems, guess[index].tolist(), strict=True):
            c = max(n for n in range(129) if math.comb(n, j) <= rem)
            assert g in (c, c - 1)
            low, exact = low + (g == c - 1), exact + (g == c)
    assert low > 0 and exact > 0


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bfloat16]
)
@pytest.mark.parametrize("codec_name", ["uint8", "int32", "packed"])
def test_decode_dtypes_match_a_plain_cast(codec_name, dtype):
    routes = random_routes(37, 3, 128, 8, seed=5)
    codec = RoutingCodec(128, 8, codec_name)
    decoded = codec.decode(codec.encode(routes), dtype)
    reference = routes.sort(dim=-1).values if codec_name == "packed" else routes
    assert decoded.dtype == dtype and decoded.shape == routes.shape
    assert torch.equal(decoded, reference.to(dtype))
