"""Flat buckets: cuts, packing, and the fused NaN/Inf check the sender runs once per bucket."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout import flat_bucket


def test_buckets_keep_order_respect_the_size_and_cut_where_a_start_would_be_unaligned():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    names = [[n for n, _ in b] for b in flat_bucket.flat_buckets(tensors, bucket_bytes=80)]
    assert names == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    mixed = [("h", torch.zeros(3, dtype=torch.bfloat16)), ("f", torch.zeros(2))]
    mixed += [("b", torch.zeros(1, dtype=torch.uint8)), ("g", torch.zeros(1, dtype=torch.float16))]
    cut = [[n for n, _ in b] for b in flat_bucket.flat_buckets(mixed, bucket_bytes=1 << 20)]
    assert cut == [["h"], ["f", "b"], ["g"]]  # 6 bytes then fp32; 9 bytes then fp16


def test_the_first_bucket_can_be_smaller():
    tensors = [(f"t{i}", torch.zeros(10)) for i in range(6)]  # 40 bytes each
    sizes = [len(b) for b in flat_bucket.flat_buckets(tensors, 120, first_bucket_bytes=40)]
    assert sizes == [1, 3, 2]


def test_pack_then_unpack_returns_the_tensors_as_views():
    bucket = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.tensor([7, 8]))]
    flat = torch.zeros(64, dtype=torch.uint8)
    slots = flat_bucket.pack(bucket, flat)
    assert [(s.start, s.end) for s in slots] == [(0, 24), (24, 40)]
    views = flat_bucket.unpack(flat, slots)
    assert all(torch.equal(v, t) for (_, v), (_, t) in zip(views, bucket, strict=True))
    views[0][1][1].zero_()  # a view, not a copy
    assert flat[:24].view(torch.float32).sum() == 0 + 1 + 2
    with pytest.raises(ValueError, match="out must be"):
        flat_bucket.pack(bucket, torch.zeros(39, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_first_nonfinite_names_the_tensor_in_a_same_dtype_run(dtype, bad):
    bucket = [(f"w{i}", torch.randn(4, 8).to(dtype)) for i in range(4)]
    bucket.insert(2, ("ids", torch.tensor([1, 2, 3])))  # ints end a run and are not checked
    flat = torch.empty(4096, dtype=torch.uint8)
    slots = flat_bucket.pack(bucket, flat)
    assert flat_bucket.first_nonfinite(flat, slots) is None
    bucket[3][1][3, 7] = bad
    slots = flat_bucket.pack(bucket, flat)
    assert flat_bucket.first_nonfinite(flat, slots) == "w2"
    assert flat_bucket.nonfinite_name(bucket) == "w2"


def test_large_finite_values_pass_where_a_sum_would_overflow():
    """The check is min/max, so no false alarm where a sum-based check overflows."""
    big = torch.full((4096,), 65504.0, dtype=torch.float16)
    assert not torch.isfinite(big.sum())
    flat = torch.empty(big.numel() * 2, dtype=torch.uint8)
    slots = flat_bucket.pack([("big", big)], flat)
    assert flat_bucket.first_nonfinite(flat, slots) is None


def test_nonfinite_name_reports_the_first_bad_tensor_in_stream_order_across_dtypes():
    from megatron_rl.rollout.flat_bucket import nonfinite_name

    named = [
        ("a", torch.ones(3)),
        ("b", torch.ones(2, dtype=torch.bfloat16)),
        ("ids", torch.arange(4)),  # integers are never checked
        ("c", torch.tensor([1.0, float("nan")])),
        ("d", torch.tensor([float("-inf")], dtype=torch.bfloat16)),
        ("empty", torch.empty(0)),
    ]
    assert nonfinite_name(named) == "c"
    assert nonfinite_name(named[:3] + named[4:]) == "d"
    assert nonfinite_name(named[:3]) is None
    huge = torch.full((4,), 3e38)  # finite values whose squares overflow: still finite
    assert nonfinite_name([("huge", huge)]) is None


def _mla_layer(i: int, fp8: bool) -> list[tuple[str, torch.Tensor]]:
    """One DeepSeek-V3-style layer in the converter's order (q_a, q_a_ln, q_b, kv_a, ...)."""
    p = f"model.layers.{i}.self_attn."
    weight = torch.float8_e4m3fn if fp8 else torch.bfloat16

    def w(name, n):
        out = [(p + name + ".weight", torch.zeros(n, dtype=weight))]
        return out + ([(p + name + ".weight_scale_inv", torch.zeros(3))] if fp8 else [])

    return [
        *w("q_a_proj", 24), (p + "q_a_layernorm.weight", torch.zeros(6, dtype=torch.bfloat16)),
        *w("q_b_proj", 40), *w("kv_a_proj_with_mqa", 20),
        (p + "kv_a_layernorm.weight", torch.zeros(5, dtype=torch.bfloat16)),
        *w("kv_b_proj", 30), *w("o_proj", 36),
        (f"model.layers.{i}.mlp.gate.weight", torch.zeros(8, dtype=torch.bfloat16)),
    ]  # fmt: skip


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_layers_q_a_and_kv_a_always_travel_in_one_bucket_whatever_the_cuts(fp8):
    """SGLang fuses q_a_proj and kv_a_proj_with_mqa only within one load call (one bucket); a
    lone half is dropped silently. Every bucket size from tiny to whole keeps them together, sends
    every tensor once, and keeps every bucket's layout aligned."""
    stream = [t for i in range(4) for t in _mla_layer(i, fp8)]
    total = sum(t.numel() * t.element_size() for _, t in stream)
    for bucket_bytes in range(8, total + 16, 7):
        buckets = list(flat_bucket.flat_buckets(stream, bucket_bytes, first_bucket_bytes=16))
        sent = sorted(n for b in buckets for n, _ in b)
        assert sent == sorted(n for n, _ in stream), bucket_bytes
        where = {n: k for k, b in enumerate(buckets) for n, _ in b}
        for i in range(4):
            p = f"model.layers.{i}.self_attn."
            group = [n for n in where if n.startswith(p + "q_a_proj.") or n.startswith(p + "kv_a_")]
            group = [n for n in group if flat_bucket.fuse_group(n)]
            assert len(group) == (4 if fp8 else 2) and len({where[n] for n in group}) == 1
        for b in buckets:  # SGLang's unpadded layout accepts every bucket
            flat_bucket.layout([n for n, _ in b], [t.dtype for _, t in b], [t.shape for _, t in b])


def test_streams_without_fuse_groups_are_cut_as_before():
    assert flat_bucket.fuse_group("model.layers.3.self_attn.q_a_proj.weight") == (
        "model.layers.3.self_attn."
    )
    assert flat_bucket.fuse_group("model.layers.3.self_attn.q_a_layernorm.weight") is None
    assert flat_bucket.fuse_group("model.layers.3.self_attn.q_proj.weight") is None
    tensors = [(f"model.layers.0.self_attn.{k}.weight", torch.zeros(10)) for k in "qkvo"]
    cut = [[n[-8] for n, _ in b] for b in flat_bucket.flat_buckets(tensors, bucket_bytes=80)]
    assert cut == [["q", "k"], ["v", "o"]]
