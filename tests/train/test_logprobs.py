"""Per-token log-probs and entropy through megatron's vocab-parallel cross-entropy.

TP=1 results are compared with ``log_softmax(logits[:, :-1] / T)`` gathered at ``tokens[:, 1:]``
computed directly with torch; TP=2 (two gloo ranks, each holding half of the vocabulary) must give
the same numbers and the matching slice of the full-vocabulary gradient.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from qwen3_moe_testing import spawn_ranks

from megatron_rl.backend import ParallelConfig, init_distributed
from megatron_rl.train.logprobs import token_entropy, token_logprobs

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


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_token_logprobs_leave_single_row_logits_untouched(ws1, temperature):
    # megatron's vocab_parallel_cross_entropy works in place on its input; a single float32 row
    # needs no transpose copy or cast, so the caller's logits must still be protected (the
    # trainer computes the entropy metric from the same logits afterwards).
    logits, tokens = _inputs(seed=6, batch=1)
    before = logits.clone()
    token_logprobs(logits, tokens, temperature)
    assert torch.equal(logits, before)
    torch.testing.assert_close(
        token_entropy(logits).double(), _reference_entropy(before, 1.0), atol=ATOL, rtol=0
    )


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
    for temperature in (1.0, 0.7):
        local = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
        logprobs = token_logprobs(local, tokens, temperature)
        (logprobs * weights).sum().backward()
        result[temperature] = {
            "logprobs": logprobs.detach(),
            "grad": local.grad,
            "entropy": token_entropy(local.detach(), temperature),
        }
    torch.save(result, os.path.join(tmp_dir, f"result{rank}.pt"))


@pytest.mark.slow  # two spawned ranks each import megatron-core: ~20 s on 2 busy cores
@pytest.mark.distributed
def test_tp2_vocab_shards_give_the_full_vocabulary_values(tmp_path):
    logits, tokens = _inputs(seed=7)
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(8))
    torch.save({"logits": logits, "tokens": tokens, "weights": weights}, tmp_path / "inputs.pt")
    spawn_ranks(_tp2_worker, tmp_path, 2)
    shard = VOCAB // 2
    for temperature in (1.0, 0.7):
        expected_lp = _reference_logprobs(logits, tokens, temperature)
        expected_ent = _reference_entropy(logits, temperature)
        direct = logits.clone().requires_grad_()
        ref = torch.log_softmax(direct[:, :-1] / temperature, dim=-1)
        (ref.gather(-1, tokens[:, 1:, None]).squeeze(-1) * weights).sum().backward()
        for rank in range(2):
            result = torch.load(tmp_path / f"result{rank}.pt")[temperature]
            assert result["logprobs"].shape == (BATCH, SEQ - 1)
            torch.testing.assert_close(result["logprobs"].double(), expected_lp, atol=ATOL, rtol=0)
            torch.testing.assert_close(result["entropy"].double(), expected_ent, atol=ATOL, rtol=0)
            torch.testing.assert_close(
                result["grad"],
                direct.grad[..., rank * shard : (rank + 1) * shard],
                atol=ATOL,
                rtol=0,
            )
