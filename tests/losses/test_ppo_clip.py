"""GRPO / DAPO: closed-form values, gradients and clip fractions on hand-made inputs."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.losses import compute_policy_loss

RATIOS = [1.5, 0.5, 1.0]


def _hand_batch():
    """Two sequences with token ratios 1.5, 0.5, 1.0; advantages +1 and -1."""
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    lp = (old + torch.log(torch.tensor([RATIOS, RATIOS], dtype=torch.float64))).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    return dict(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask)


def test_grpo_value_and_gradient_match_the_clipped_surrogate():
    kw = _hand_batch()
    out = compute_policy_loss("grpo", **kw)
    # A=+1: max(-r, -clip(r)) = [-1.2 (clipped), -0.5, -1]; A=-1: [1.5, 0.8 (clipped), 1]
    expected = ((-1.2 - 0.5 - 1.0) / 3 + (1.5 + 0.8 + 1.0) / 3) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, kw["logprobs"])
    # d(-A r)/d log pi = -A r on unclipped tokens, 0 on clipped; seq-mean-token-mean -> / (3 * 2)
    expected_grad = torch.tensor([[0.0, -0.5, -1.0], [1.5, 0.0, 1.0]], dtype=torch.float64) / 6
    torch.testing.assert_close(grad, expected_grad)
    assert out.metrics["grpo/clip_frac_high"].item() == pytest.approx(1 / 6)
    assert out.metrics["grpo/clip_frac_low"].item() == pytest.approx(1 / 6)


def test_grpo_dual_clip_bounds_negative_advantage_tokens():
    kw = _hand_batch()
    out = compute_policy_loss("grpo", clip_ratio_c=1.4, **kw)
    expected = ((-1.2 - 0.5 - 1.0) / 3 + (1.4 + 0.8 + 1.0) / 3) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, kw["logprobs"])
    assert grad[1, 0].item() == 0.0  # r = 1.5 > c: dual-clipped, no gradient
    assert out.metrics["grpo/dual_clip_frac"].item() == pytest.approx(1 / 6)


def test_dapo_uses_clip_higher_and_token_mean():
    kw = _hand_batch()
    out = compute_policy_loss("dapo", **kw)
    expected = (-1.28 - 0.5 - 1.0 + 1.5 + 0.8 + 1.0) / 6
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)


def test_grpo_per_token_loss_is_zero_outside_the_mask():
    kw = _hand_batch()
    kw["loss_mask"] = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = compute_policy_loss("grpo", **kw)
    assert out.per_token_loss[0, 2].item() == 0.0 and out.per_token_loss[1, 1:].abs().sum() == 0
    expected = ((-1.2 - 0.5) / 2 + 1.5) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)


def test_grpo_huge_ratio_with_negative_advantage_stays_finite_with_exp_gradient_at_cap():
    old = torch.tensor([[-5000.0]], dtype=torch.float64)
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    out = compute_policy_loss(
        "grpo",
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([-1.0], dtype=torch.float64),
        loss_mask=torch.ones(1, 1, dtype=torch.bool),
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert out.loss.item() == pytest.approx(math.exp(20.0))
    assert grad.item() == pytest.approx(math.exp(20.0))
