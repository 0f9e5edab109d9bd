"""GSPO and GSPO-token: sequence-ratio clipping, equal gradients for sequence advantages."""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import loss_and_grad, make_batch

from megatron_rl.losses import compute_policy_loss


def _seq_batch():
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    log_ratios = torch.tensor([[0.3, -0.1, 0.1], [0.3, -0.1, 0.1]], dtype=torch.float64)
    lp = (old + log_ratios).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return dict(
        logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=torch.ones(2, 3, dtype=torch.bool)
    )


def test_gspo_clips_the_length_normalised_sequence_ratio():
    kw = _seq_batch()
    s = math.exp(0.1)  # exp(mean log-ratio) = 1.105 > 1 + 0.1
    out = compute_policy_loss("gspo", clip_low=0.1, clip_high=0.1, **kw)
    assert out.loss.item() == pytest.approx((-1.1 + s) / 2, abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, kw["logprobs"])
    # A=+1 above 1+eps: clipped; A=-1: unclipped branch -A s, d s / d lp_t = s / |y|
    expected = torch.tensor([[0.0] * 3, [s / 3 / 2] * 3], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)


def test_gspo_token_equals_gspo_for_sequence_advantages():
    b = make_batch(seed=3, drift=1e-4)
    loss_seq, grad_seq = loss_and_grad("gspo", **b.kwargs())
    loss_tok, grad_tok = loss_and_grad("gspo_token", **b.kwargs())
    torch.testing.assert_close(loss_tok, loss_seq)
    torch.testing.assert_close(grad_tok, grad_seq)
    assert grad_seq.abs().sum() > 0


def test_gspo_token_gradient_is_per_token_advantage_times_sequence_ratio():
    b = make_batch(seed=4, drift=1e-5)
    adv_BT = torch.randn(b.loss_mask.shape, dtype=torch.float64)
    kw = b.kwargs() | {"advantages": adv_BT}
    _, grad = loss_and_grad("gspo_token", clip_low=1.0 - 1e-9, clip_high=1e9, **kw)
    mask = b.loss_mask
    n_B = mask.sum(-1, keepdim=True)
    log_s_B = ((b.logprobs.detach() - b.old_logprobs) * mask).sum(-1, keepdim=True) / n_B
    expected = -adv_BT * log_s_B.exp() / n_B / mask.shape[0] * mask
    torch.testing.assert_close(grad, expected)


def test_gspo_rejects_advantages_that_vary_within_a_sequence():
    b = make_batch()
    adv_BT = torch.randn(b.loss_mask.shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="gspo_token"):
        compute_policy_loss("gspo", **(b.kwargs() | {"advantages": adv_BT}))
