"""Routing codecs: round trips (property-based), exact byte counts, dtype choice, bad input."""

from __future__ import annotations

import math

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
