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
