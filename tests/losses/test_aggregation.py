"""Aggregation modes: closed forms, and global denominators making micro-batches add up to the
full batch (loss and gradient) for every loss and mode."""

from __future__ import annotations

import pytest
import torch
from loss_batches import loss_and_grad, make_batch
from paper_losses import PAPER_LOSSES

from megatron_rl.losses import AGGREGATION_MODES, compute_policy_loss
from megatron_rl.losses.aggregation import aggregate_padded


def test_aggregation_closed_forms():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate_padded(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_padded(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_padded(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    norm = aggregate_padded(loss, mask, "seq-mean-token-sum-norm", max_response_length=5)
    assert norm.item() == pytest.approx((6 + 4) / (2 * 5))
    assert aggregate_padded(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 6)


def test_sequences_without_tokens_are_not_counted():
    loss = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    assert aggregate_padded(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)


@pytest.mark.parametrize("name", PAPER_LOSSES)
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_with_global_denominators_match_full_batch(name, mode):
    b = make_batch(num_seqs=9, max_len=10, seed=40)
    common = dict(loss_agg_mode=mode, max_response_length=12)
    full_loss, full_grad = loss_and_grad(name, **common, **b.kwargs())

    global_counts = dict(
        global_num_tokens=int(b.loss_mask.sum()),
        global_num_seqs=int(b.loss_mask.any(-1).sum()),
    )
    total_loss = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 7), slice(7, 9)):  # uneven micro-batches
        kw = dict(
            logprobs=b.logprobs[rows],
            old_logprobs=b.old_logprobs[rows],
            advantages=b.advantages[rows],
            loss_mask=b.loss_mask[rows],
        )
        out = compute_policy_loss(name, **common, **global_counts, **kw)
        out.loss.backward()
        total_loss += out.loss.detach()
    torch.testing.assert_close(total_loss, full_loss)
    torch.testing.assert_close(b.logprobs.grad, full_grad)


def test_token_mean_over_micro_batches_without_global_denominator_is_biased():
    """The reason global denominators exist: averaging local token-means is not the full mean."""
    b = make_batch(num_seqs=4, max_len=10, seed=41)
    full = compute_policy_loss("dapo", **b.kwargs()).loss
    halves = [
        compute_policy_loss(
            "dapo",
            logprobs=b.logprobs[rows],
            old_logprobs=b.old_logprobs[rows],
            advantages=b.advantages[rows],
            loss_mask=b.loss_mask[rows],
        ).loss
        for rows in (slice(0, 3), slice(3, 4))
    ]
    assert abs((sum(halves) / 2 - full).item()) > 1e-6
