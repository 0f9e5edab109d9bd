"""The trainer's log-probs renormalised on the recorded sampling support: a float64 reference,
its gradient, the tensor-parallel shards, positions without a support, the micro-batch layout."""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import spawn_ranks

from megatron_rl.backend import ParallelConfig, init_distributed
from megatron_rl.train.batch import TrainSample, make_micro_batch, merge_micro_batches
from megatron_rl.train.logprobs import token_logprobs
from megatron_rl.train.support_logprobs import policy_logprobs, support_token_logprobs

BATCH, SEQ, VOCAB, K = 3, 7, 12, 4


def _inputs(seed: int = 0):
    """Logits ``[b, s, V]``, tokens ``[b, s]`` and supports ``[b, s - 1, K]`` (-1 padded, of
    1..K ids from both halves of the vocabulary, each holding its target); row 2's first two
    positions have none (a prompt)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    support = torch.full((BATCH, SEQ - 1, K), -1, dtype=torch.int64)
    for b in range(BATCH):
        for t in range(SEQ - 1):
            size = int(torch.randint(1, K + 1, (1,), generator=gen))
            others = torch.randperm(VOCAB, generator=gen)
            ids = [int(tokens[b, t + 1])] + [int(v) for v in others if v != tokens[b, t + 1]]
            support[b, t, :size] = torch.tensor(ids[:size])[torch.randperm(size, generator=gen)]
    support[2, :2] = -1
    return logits, tokens, support


def _reference(logits, tokens, support, temperature):
    """float64 ``log(p(y) / sum_S p)`` from a dense mask; 0 where there is no support."""
    scaled = logits[:, :-1].double() / temperature
    mask = torch.zeros(scaled.shape, dtype=torch.bool)
    present = support >= 0
    mask.scatter_(-1, support.clamp(min=0), present)
    logp = torch.log_softmax(scaled.masked_fill(~mask, float("-inf")), dim=-1)
    out = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.where(present.any(-1), out, torch.zeros_like(out))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equal_the_float64_renormalised_logprob_and_its_gradient(ws1, temperature):
    logits, tokens, support = _inputs()
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(1))
    mine = logits.clone().requires_grad_()
    out = support_token_logprobs(mine, tokens, support, temperature)
    (out * weights).sum().backward()
    ref_logits = logits.double().requires_grad_()
    ref = _reference(ref_logits, tokens, support, temperature)
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(mine.grad.double(), ref_logits.grad, atol=2e-6, rtol=0)
    assert torch.isfinite(mine.grad).all()
    assert out[2, :2].tolist() == [0.0, 0.0]
    # the renormalisation matters: the full-vocabulary log-prob is lower wherever S misses mass
    full = token_logprobs(logits, tokens, temperature)
    partial = (support >= 0).sum(-1) < VOCAB
    assert bool((full[partial] < out.detach()[partial] - 1e-4).all())


def test_a_one_token_support_gives_log_prob_zero_and_no_gradient(ws1):
    logits, tokens, _ = _inputs(seed=3)
    support = torch.full((BATCH, SEQ - 1, 1), -1, dtype=torch.int64)
    support[..., 0] = tokens[:, 1:]
    mine = logits.clone().requires_grad_()
    out = support_token_logprobs(mine, tokens, support, 1.0)
    out.sum().backward()
    assert out.abs().max() < 1e-6 and mine.grad.abs().max() < 1e-6


def test_the_layout_is_checked(ws1):
    logits, tokens, support = _inputs()
    with pytest.raises(ValueError, match=r"support_BTK \(3, 5, 4\) must be \[b, s - 1, K\]"):
        support_token_logprobs(logits, tokens, support[:, 1:], 1.0)


def _sample(prompt, response, support=None) -> TrainSample:
    return TrainSample(
        prompt_ids=torch.tensor(prompt),
        response_ids=torch.tensor(response),
        rollout_logprobs=torch.zeros(len(response)),
        advantage=1.0,
        reward=1.0,
        in_loss=True,
        support_RK=None if support is None else torch.tensor(support, dtype=torch.int32),
    )


def test_micro_batches_put_each_tokens_support_at_its_predicted_position():
    a = _sample([1, 2], [5, 6], [[5, 3], [6, -1]])
    b = _sample([1], [7, 8, 9], [[7], [8], [9]])
    mb = make_micro_batch([a, b], pad_id=0)
    assert mb.support_BTK.shape == (2, 3, 2)
    assert mb.support_BTK[0].tolist() == [[-1, -1], [5, 3], [6, -1]]
    assert mb.support_BTK[1].tolist() == [[7, -1], [8, -1], [9, -1]]
    merged = merge_micro_batches([mb, make_micro_batch([_sample([4], [2], [[2, 1, 0]])], 0)])
    assert merged.support_BTK.shape == (3, 3, 3)
    assert merged.support_BTK[2].tolist() == [[2, 1, 0], [-1, -1, -1], [-1, -1, -1]]
    assert merged.support_BTK[0, 1].tolist() == [5, 3, -1]
    assert make_micro_batch([_sample([1], [2])], 0).support_BTK is None
    with pytest.raises(ValueError, match=r"samples \[1\] have no sampling support"):
        make_micro_batch([a, _sample([1], [2])], pad_id=0)


def test_policy_logprobs_take_the_support_when_the_micro_batch_has_one(ws1):
    a = _sample([1, 2], [5, 6], [[5, 3], [6, -1]])
    mb = make_micro_batch([a], pad_id=0)
    logits = torch.randn(1, 4, VOCAB, generator=torch.Generator().manual_seed(2))
    on_support = policy_logprobs(logits, mb, 1.0)
    assert on_support[0, 2] == 0  # a one-token support
    torch.testing.assert_close(
        on_support[0, 1], torch.log_softmax(logits[0, 1, [5, 3]], -1)[0], atol=1e-6, rtol=0
    )
    plain = make_micro_batch([_sample([1, 2], [5, 6])], pad_id=0)
    torch.testing.assert_close(
        policy_logprobs(logits, plain, 1.0), token_logprobs(logits, plain.tokens_BS, 1.0)
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
    shard = VOCAB // world_size
    local = data["logits"][..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
    out = support_token_logprobs(local, data["tokens"], data["support"], 0.7)
    (out * data["weights"]).sum().backward()
    torch.save({"out": out.detach(), "grad": local.grad}, os.path.join(tmp_dir, f"r{rank}.pt"))


@pytest.mark.slow  # two spawned ranks each import megatron-core
@pytest.mark.distributed
def test_tp2_vocab_shards_give_the_full_vocabulary_values(tmp_path, ws1):
    logits, tokens, support = _inputs(seed=5)
    weights = torch.randn(BATCH, SEQ - 1, generator=torch.Generator().manual_seed(6))
    torch.save(
        {"logits": logits, "tokens": tokens, "support": support, "weights": weights},
        tmp_path / "inputs.pt",
    )
    spawn_ranks(_tp2_worker, tmp_path, 2)
    full = logits.clone().requires_grad_()
    want = support_token_logprobs(full, tokens, support, 0.7)
    (want * weights).sum().backward()
    shard = VOCAB // 2
    for rank in range(2):
        got = torch.load(tmp_path / f"r{rank}.pt")
        torch.testing.assert_close(got["out"], want.detach(), atol=2e-6, rtol=0)
        torch.testing.assert_close(
            got["grad"], full.grad[..., rank * shard : (rank + 1) * shard], atol=2e-6, rtol=0
        )
