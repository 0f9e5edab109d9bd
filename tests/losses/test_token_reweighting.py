"""SAPO, CISPO and TOPR: closed-form gradients of the reweighted REINFORCE-style losses."""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import float64_batch, loss_and_grad, make_batch

from megatron_rl.losses import compute_policy_loss


def _sapo_direct(lp, olp, adv_BT, tau_pos, tau_neg):
    """SAPO surrogate f(r) A written directly (differentiable), for moderate ratios."""
    r = torch.exp(lp - olp)
    tau_pos, tau_neg = (torch.tensor(v, dtype=lp.dtype) for v in (tau_pos, tau_neg))
    tau = torch.where(adv_BT >= 0, tau_pos, tau_neg)
    return torch.sigmoid(tau * (r - 1)) * 4 / tau * adv_BT


def _sapo_closed_form(log_r: float, a: float, tau: float) -> tuple[float, float]:
    """Per-token loss ``-A 4 sigma(z) / tau`` and its derivative ``-A 4 sigma(z) sigma(-z) r``."""
    z = tau * math.expm1(log_r)
    s = 1.0 / (1.0 + math.exp(-z))
    return -a * 4.0 * s / tau, -a * 4.0 * s * (1.0 - s) * math.exp(log_r)


@pytest.mark.parametrize("scale", [1e-3, 0.5])
@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (0.7, 1.3)])
def test_sapo_float64_matches_closed_form_to_1e_13(scale, tau_pos, tau_neg):
    """float64 in, float64 math throughout: temperatures are not rounded to float32."""
    lp, old, adv, mask = float64_batch(31, scale)
    out = compute_policy_loss(
        "sapo",
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        logprobs=lp,
        old_logprobs=old,
        advantages=adv,
        loss_mask=mask,
        loss_agg_mode="seq-mean-token-sum",
        global_num_seqs=1,  # loss = sum of per-token losses, gradient = per-token derivative
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    log_r = (lp.detach() - old).tolist()
    expected = [
        [_sapo_closed_form(x, a, tau_pos if a >= 0 else tau_neg) for x in row]
        for row, a in zip(log_r, adv.tolist(), strict=True)
    ]
    value = torch.tensor([[v for v, _ in row] for row in expected], dtype=torch.float64)
    dvalue = torch.tensor([[d for _, d in row] for row in expected], dtype=torch.float64)
    torch.testing.assert_close(out.per_token_loss.detach(), value, rtol=1e-13, atol=0.0)
    torch.testing.assert_close(grad, dvalue, rtol=1e-13, atol=0.0)


def test_sapo_matches_autograd_of_the_soft_gate():
    b = make_batch(seed=7, drift=0.8)
    loss, grad = loss_and_grad("sapo", **b.kwargs())
    mask = b.loss_mask
    lp = b.logprobs.detach().clone().requires_grad_()
    adv_BT = b.advantages[:, None].expand_as(mask)
    objective = _sapo_direct(lp, b.old_logprobs, adv_BT, 1.0, 1.05) * mask
    expected = -((objective.sum(-1) / mask.sum(-1)).mean())
    (expected_grad,) = torch.autograd.grad(expected, lp)
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(grad, expected_grad)


def test_sapo_on_policy_gradient_equals_the_unclipped_policy_gradient():
    b = make_batch(seed=8)
    b.logprobs = b.old_logprobs.clone().requires_grad_()
    _, grad = loss_and_grad("sapo", **b.kwargs())
    mask = b.loss_mask
    expected = -b.advantages[:, None] / mask.sum(-1, keepdim=True) / mask.shape[0] * mask
    torch.testing.assert_close(grad, expected)


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage():
    b = make_batch(seed=9, drift=0.5)
    _, grad = loss_and_grad("cispo", **b.kwargs())
    mask = b.loss_mask
    ratio = torch.exp(b.logprobs.detach() - b.old_logprobs)
    expected = -ratio.clamp(max=1.28) * b.advantages[:, None] / mask.sum() * mask
    torch.testing.assert_close(grad, expected)
    assert (ratio[mask] > 1.28).any() and (ratio[mask] < 0.5).any()


def test_cispo_lower_clip_when_requested():
    b = make_batch(seed=9, drift=0.5)
    _, grad = loss_and_grad("cispo", clip_low=0.2, clip_high=0.2, **b.kwargs())
    ratio = torch.exp(b.logprobs.detach() - b.old_logprobs).clamp(0.8, 1.2)
    mask = b.loss_mask
    torch.testing.assert_close(grad, -ratio * b.advantages[:, None] / mask.sum() * mask)


def test_topr_truncates_only_negative_sequences():
    b = make_batch(seed=10, drift=0.4)
    _, grad = loss_and_grad("topr", **b.kwargs())
    mask = b.loss_mask
    log_w = ((b.logprobs.detach() - b.old_logprobs) * mask).sum(-1)
    weight = torch.where(b.advantages >= 0, 1.0, log_w.exp().clamp(max=1.0))
    expected = -(weight * b.advantages)[:, None] / mask.shape[0] * mask  # seq-mean-token-sum
    torch.testing.assert_close(grad, expected)
    negative = b.advantages < 0
    assert (negative & (log_w > 0)).any() or (negative & (log_w < 0)).any()


def test_topr_weight_is_bounded_by_one_for_huge_negative_sequence_ratio():
    old = torch.full((1, 4), -3000.0, dtype=torch.float64)
    lp = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    kw = dict(
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([-2.0]).double(),
        loss_mask=torch.ones(1, 4, dtype=torch.bool),
    )
    _, grad = loss_and_grad("topr", **kw)
    assert torch.allclose(grad, torch.full_like(grad, 2.0))
    assert math.isfinite(grad.sum().item())


@pytest.mark.parametrize("name", ["cispo", "topr", "vespo"])
def test_reinforce_style_weights_carry_no_gradient(name):
    """With a detached weight the loss is linear in log pi: its second derivative is zero."""
    b = make_batch(seed=11, drift=0.3)
    out = compute_policy_loss(name, **b.kwargs())
    (grad,) = torch.autograd.grad(out.loss, b.logprobs, create_graph=True)
    assert grad.abs().sum().item() > 0
    if grad.requires_grad:
        (hessian_row_sums,) = torch.autograd.grad(grad.sum(), b.logprobs, allow_unused=True)
        assert hessian_row_sums is None or hessian_row_sums.abs().max().item() == 0.0
