"""Per-token log-probs and entropy through megatron's vocab-parallel cross-entropy.

TP=1 results are compared with ``log_softmax(logits[:, :-1] / T)`` gathered at ``tokens[:, 1:]``
computed directly with torch; TP=2 (two gloo ranks, each holding half of the vocabulary) must give
the same numbers and the matching slice of the full-vocabulary gradient, without gathering the
vocabulary. Chunking over tokens (``chunk_tokens``) must not change a bit of the log-probs, their
gradient or the entropy, and must bound the transient memory by a few chunk-sized float32 tiles
(measured with the profiler's record of every CPU allocation).
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from megatron.core import tensor_parallel
from qwen3_moe_testing import spawn_ranks
from torch.profiler import ProfilerActivity, profile

from megatron_rl.backend import ParallelConfig, init_distributed
from megatron_rl.train.logprobs import DEFAULT_CHUNK_TOKENS, _tiles, token_entropy, token_logprobs

BATCH, SEQ, VOCAB = 3, 7, 10
ATOL = 2e-6


def _inputs(seed: int = 0, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(batch, SEQ, VOCAB, generator=gen)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    # Targets from both halves of the vocabulary (both TP=2 shards) are certainly present.
    tokens[0, 1], tokens[0, 2] = 0, VOCAB - 1
    return logits, tokens


def _reference_logprobs(logits, tokens, temperature):
    logp = torch.log_softmax(logits[:, :-1].double() / temperature, dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _reference_entropy(logits, temperature):
    p = torch.softmax(logits[:, :-1].double() / temperature, dim=-1)
    return -(p * torch.log(p)).sum(dim=-1)


def _one_kernel_call(logits, tokens, temperature):
    """The unchunked computation: one megatron call on a float32 copy of all of ``[:, :-1]``."""
    logits_TBv = logits[:, :-1].transpose(0, 1).float()
    if temperature not in (0.0, 1.0):
        logits_TBv = logits_TBv / temperature
    logits_TBv = logits_TBv.clone(memory_format=torch.contiguous_format)  # worked on in place
    target_TB = tokens[:, 1:].transpose(0, 1).contiguous()
    return -tensor_parallel.vocab_parallel_cross_entropy(logits_TBv, target_TB).transpose(0, 1)


def _peak_extra_bytes(fn):
    """``(peak bytes fn holds on top of what was allocated before, fn's result)``.

    Every allocation and free of torch's CPU allocator while ``fn`` runs, as recorded by the
    profiler (``profile_memory=True``), summed in time order.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak, result


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_log_softmax_at_next_token(ws1, temperature):
    logits, tokens = _inputs()
    expected = _reference_logprobs(logits, tokens, temperature)
    got = token_logprobs(logits.clone(), tokens, temperature)
    assert got.shape == (BATCH, SEQ - 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    assert (got <= 0).all()


def test_token_logprobs_hand_computed(ws1):
    # logits (0, ln 2, ln 3): p = (1, 2, 3) / 6; at T = 0.5 p = (1, 4, 9) / 14.
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)], [5.0, -1.0, 2.0]]])
    logits = torch.cat([logits, logits])  # two rows
    tokens = torch.tensor([[0, 2], [0, 1]])
    got = token_logprobs(logits.clone(), tokens, 1.0)
    expected = torch.tensor([[math.log(3 / 6)], [math.log(2 / 6)]])
    torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=0)
    got = token_logprobs(logits.clone(), tokens, 0.5)
    expected = torch.tensor([[math.log(9 / 14)], [math.log(4 / 14)]])
    torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=0)


def test_token_logprobs_upcast_bf16_logits(ws1):
    logits, tokens = _inputs(seed=3)
    logits = logits.bfloat16()
    got = token_logprobs(logits, tokens, 0.7)
    assert got.dtype == torch.float32
    expected = _reference_logprobs(logits.float(), tokens, 0.7)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_gradient_matches_direct_computation(ws1, temperature):
    logits, tokens = _inputs(seed=1)
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(2))

    direct = logits.clone().requires_grad_()
    ref = torch.log_softmax(direct[:, :-1] / temperature, dim=-1)
    (ref.gather(-1, tokens[:, 1:, None]).squeeze(-1) * weights).sum().backward()

    leaf = logits.clone().requires_grad_()
    (token_logprobs(leaf, tokens, temperature) * weights).sum().backward()

    assert leaf.grad.shape == (BATCH, SEQ, VOCAB)
    assert not leaf.grad[:, -1].any(), "the last position predicts nothing"
    torch.testing.assert_close(leaf.grad, direct.grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_is_minus_sum_p_log_p(ws1, temperature):
    logits, _ = _inputs(seed=4)
    got = token_entropy(logits, temperature)
    assert got.shape == (BATCH, SEQ - 1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got.double(), _reference_entropy(logits, temperature), atol=ATOL, rtol=0
    )
    assert not got.requires_grad


def test_token_entropy_extremes(ws1):
    # Equal logits: uniform, entropy ln V. One dominant logit: entropy ~ 0.
    uniform = torch.full((2, 3, VOCAB), 1.5)
    torch.testing.assert_close(token_entropy(uniform), torch.full((2, 2), math.log(VOCAB)))
    peaked = torch.zeros(2, 3, VOCAB)
    peaked[..., 4] = 100.0
    assert token_entropy(peaked).abs().max() < 1e-6
    # Lower temperature sharpens the distribution.
    logits, _ = _inputs(seed=5)
    assert (token_entropy(logits, 0.5) < token_entropy(logits, 1.0)).all()


@pytest.mark.parametrize("chunk_tokens", [1, DEFAULT_CHUNK_TOKENS])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_token_logprobs_leave_single_row_logits_untouched(ws1, temperature, chunk_tokens):
    # megatron's vocab_parallel_cross_entropy works in place on its input; a single float32 row
    # needs no transpose copy or cast, so the caller's logits must still be protected (the
    # trainer computes the entropy metric from the same logits afterwards).
    logits, tokens = _inputs(seed=6, batch=1)
    before = logits.clone()
    token_logprobs(logits, tokens, temperature, chunk_tokens=chunk_tokens)
    assert torch.equal(logits, before)
    leaf = logits.clone().requires_grad_()
    token_logprobs(leaf, tokens, temperature, chunk_tokens=chunk_tokens).sum().backward()
    assert torch.equal(leaf.detach(), before)
    torch.testing.assert_close(
        token_entropy(logits).double(), _reference_entropy(before, 1.0), atol=ATOL, rtol=0
    )


# 18 positions in [3, 6]: one token per tile, two-row tiles (the last with one row), whole-batch
# tiles of one or more positions, and a single tile larger than the batch.
CHUNKS = [1, 2, 3, 5, 7, 100]


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, None])
def test_chunk_tokens_must_be_a_positive_integer(ws1, bad):
    logits, tokens = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(logits, tokens, chunk_tokens=bad)
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_entropy(logits, chunk_tokens=bad)


@pytest.mark.parametrize(("batch", "positions"), [(3, 6), (1, 9), (5, 1), (4, 0), (0, 3)])
@pytest.mark.parametrize("chunk_tokens", [1, 2, 3, 4, 7, 64])
def test_tiles_cover_every_position_once_within_the_chunk(batch, positions, chunk_tokens):
    seen = torch.zeros(batch, positions, dtype=torch.int64)
    tiles = list(_tiles(batch, positions, chunk_tokens))
    for rows, cols in tiles:
        tile = seen[rows, cols]
        assert 0 < tile.numel() <= chunk_tokens
        tile += 1
    assert (seen == 1).all()
    if 0 < batch * positions <= chunk_tokens:
        assert tiles == [(slice(0, batch), slice(0, positions))]  # the unchunked call


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
@pytest.mark.parametrize(
    ("dtype", "temperature"), [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)]
)
def test_chunked_logprobs_and_gradient_are_bitwise_the_unchunked_ones(
    ws1, chunk_tokens, dtype, temperature
):
    logits, tokens = _inputs(seed=9)
    logits = logits.to(dtype)
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(10))

    whole = logits.clone().requires_grad_()
    expected = _one_kernel_call(whole, tokens, temperature)
    (expected * weights).sum().backward()

    leaf = logits.clone().requires_grad_()
    got = token_logprobs(leaf, tokens, temperature, chunk_tokens=chunk_tokens)
    (got * weights).sum().backward()

    assert got.shape == (BATCH, SEQ - 1)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert leaf.grad.dtype == dtype
    assert torch.equal(leaf.grad, whole.grad)
    # and both are the right numbers
    torch.testing.assert_close(
        got.double(), _reference_logprobs(logits.float(), tokens, temperature), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_entropy_is_bitwise_the_unchunked_one(ws1, chunk_tokens, temperature):
    logits, _ = _inputs(seed=11)
    expected = token_entropy(logits, temperature, chunk_tokens=BATCH * SEQ)  # one tile
    got = token_entropy(logits, temperature, chunk_tokens=chunk_tokens)
    assert torch.equal(got, expected)
    torch.testing.assert_close(
        got.double(), _reference_entropy(logits, temperature), atol=ATOL, rtol=0
    )


def test_no_positions_give_empty_results(ws1):
    logits, tokens = _inputs()
    leaf = logits[:, :1].clone().requires_grad_()
    got = token_logprobs(leaf, tokens[:, :1], chunk_tokens=2)
    assert got.shape == (BATCH, 0)
    got.sum().backward()
    assert torch.equal(leaf.grad, torch.zeros_like(leaf))
    assert token_entropy(leaf.detach(), chunk_tokens=2).shape == (BATCH, 0)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_transient_memory_is_a_few_chunks_not_tokens_x_vocab(ws1, temperature):
    # [1, 2048, 8192] float32 logits: tokens x vocab is 64 MiB, a 256-token tile 8 MiB. The old
    # code needed 64 MiB (log-probs: a float32 copy of the shard), 192 MiB (entropy: log_softmax,
    # exp and their product) and 128 MiB (log-probs + backward: the saved softmax and the
    # gradient); this checks the peak of all CPU allocations, not only the largest one.
    seq, vocab, chunk = 2048, 8192, 256
    gen = torch.Generator().manual_seed(12)
    logits = 3.0 * torch.randn(1, seq, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (1, seq), generator=gen)
    tile = chunk * vocab * 4
    bound = 3 * tile  # the float32 tile, entropy's exp(tile), per-token vectors; 3/8 of 64 MiB

    def logprobs():
        with torch.no_grad():
            return token_logprobs(logits, tokens, temperature, chunk_tokens=chunk)

    def entropy():
        return token_entropy(logits, temperature, chunk_tokens=chunk)

    def logprobs_backward():
        leaf = logits.detach().requires_grad_()
        token_logprobs(leaf, tokens, temperature, chunk_tokens=chunk).sum().backward()
        return leaf.grad

    grad_bytes = logits.numel() * logits.element_size()
    allowed = {"logprobs": bound, "entropy": bound, "logprobs_backward": grad_bytes + bound}
    peaks = {}
    for fn in (logprobs, entropy, logprobs_backward):
        peaks[fn.__name__], out = _peak_extra_bytes(fn)
        assert torch.isfinite(out).all()
    mib = {
        name: f"{peak / 2**20:.1f} MiB (<= {allowed[name] / 2**20:.0f})"
        for name, peak in peaks.items()
    }
    # at least one tile: the profiler does see the allocations
    assert all(tile <= peak <= allowed[name] for name, peak in peaks.items()), mib
    # the chunked numbers are still the right ones at this size (positions across a tile edge)
    cols, window = slice(chunk - 6, chunk + 6), slice(chunk - 6, chunk + 7)
    torch.testing.assert_close(
        logprobs()[:, cols].double(),
        _reference_logprobs(logits[:, window], tokens[:, window], temperature),
        atol=1e-5,
        rtol=0,
    )
    torch.testing.assert_close(
        entropy()[:, cols].double(),
        _reference_entropy(logits[:, window], temperature),
        atol=1e-5,
        rtol=0,
    )


TP2_CHUNKS = (1, 4, DEFAULT_CHUNK_TOKENS)


def _tp2_worker(rank, world_size, init_method, tmp_dir) -> None:
    init_distributed(
        ParallelConfig(tensor_parallel=world_size),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    data = torch.load(os.path.join(tmp_dir, "inputs.pt"))
    logits, tokens, weights = data["logits"], data["tokens"], data["weights"]
    shard = VOCAB // world_size
    result = {}
    # the profiler names every collective (c10d::allreduce_, c10d::_allgather_base_, ...)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for temperature in (1.0, 0.7):
            for chunk_tokens in TP2_CHUNKS:
                local = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
                logprobs = token_logprobs(local, tokens, temperature, chunk_tokens=chunk_tokens)
                (logprobs * weights).sum().backward()
                result[temperature, chunk_tokens] = {
                    "logprobs": logprobs.detach(),
                    "grad": local.grad,
                    "entropy": token_entropy(
                        local.detach(), temperature, chunk_tokens=chunk_tokens
                    ),
                }
    result["collectives"] = {e.key for e in prof.key_averages() if e.key.startswith("c10d::")}
    torch.save(result, os.path.join(tmp_dir, f"result{rank}.pt"))


@pytest.mark.slow  # two spawned ranks each import megatron-core: ~20 s on 2 busy cores
@pytest.mark.distributed
def test_tp2_vocab_shards_give_the_full_vocabulary_values(tmp_path, ws1):
    logits, tokens = _inputs(seed=7)
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(8))
    torch.save({"logits": logits, "tokens": tokens, "weights": weights}, tmp_path / "inputs.pt")
    spawn_ranks(_tp2_worker, tmp_path, 2)
    shard = VOCAB // 2
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    for result in results:
        # the entropy reduces per-token numbers over the shards: no gather of the vocabulary
        assert "c10d::allreduce_" in result["collectives"]
        assert not [name for name in result["collectives"] if "gather" in name]
    for temperature in (1.0, 0.7):
        expected_lp = _reference_logprobs(logits, tokens, temperature)
        expected_ent = _reference_entropy(logits, temperature)
        tp1_ent = token_entropy(logits, temperature)  # this process: TP=1 (ws1)
        direct = logits.clone().requires_grad_()
        ref = torch.log_softmax(direct[:, :-1] / temperature, dim=-1)
        (ref.gather(-1, tokens[:, 1:, None]).squeeze(-1) * weights).sum().backward()
        for rank, chunk_tokens in itertools.product(range(2), TP2_CHUNKS):
            result = results[rank][temperature, chunk_tokens]
            unchunked = results[rank][temperature, DEFAULT_CHUNK_TOKENS]
            assert result["logprobs"].shape == (BATCH, SEQ - 1)
            torch.testing.assert_close(result["logprobs"].double(), expected_lp, atol=ATOL, rtol=0)
            torch.testing.assert_close(result["entropy"].double(), expected_ent, atol=ATOL, rtol=0)
            torch.testing.assert_close(result["entropy"], tp1_ent, atol=1e-6, rtol=0)
            torch.testing.assert_close(
                result["grad"],
                direct.grad[..., rank * shard : (rank + 1) * shard],
                atol=ATOL,
                rtol=0,
            )
            for key in ("logprobs", "grad", "entropy"):  # chunking changes no bit at TP=2 either
                assert torch.equal(result[key], unchunked[key]), (key, chunk_tokens)
