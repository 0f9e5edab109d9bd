"""VESPO: the kernel's paper facts, closed-form gradient and the detached weight."""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import float64_batch, loss_and_grad, make_batch

from megatron_rl.losses import compute_policy_loss
from megatron_rl.losses.vespo import vespo_kernel


def _phi(w: float, c1: float, c2: float) -> float:
    return w**c1 * math.exp(c2 * (1 - w))


@pytest.mark.parametrize(("c1", "c2"), [(2.0, 3.0), (3.0, 2.0), (1.0, 1.0)])
def test_kernel_is_one_on_policy_and_matches_the_formula(c1, c2):
    log_w = torch.linspace(-6, 3, 101, dtype=torch.float64)
    expected = torch.tensor(
        [_phi(math.exp(x), c1, c2) for x in log_w.tolist()], dtype=torch.float64
    )
    torch.testing.assert_close(vespo_kernel(log_w, c1, c2), expected)
    assert vespo_kernel(torch.zeros((), dtype=torch.float64), c1, c2).item() == 1.0


def test_kernel_constants_of_appendix_c():
    """K = sup phi(w)/w and phi_max for the paper's two settings (VESPO, App. C)."""
    w = torch.linspace(1e-4, 10, 2_000_001, dtype=torch.float64)
    phi_23 = vespo_kernel(w.log(), 2.0, 3.0)
    phi_32 = vespo_kernel(w.log(), 3.0, 2.0)
    assert (phi_23 / w).max().item() == pytest.approx(math.e**2 / 3, rel=1e-6)  # ~2.46
    assert (phi_32 / w).max().item() == pytest.approx(1.0, rel=1e-6)  # K = 1
    assert phi_23.max().item() == pytest.approx((2 / 3) ** 2 * math.e, rel=1e-6)  # ~1.21
    assert phi_32.max().item() == pytest.approx((3 / 2) ** 3 * math.exp(-1), rel=1e-6)  # ~1.24
    assert w[phi_23.argmax()].item() == pytest.approx(2 / 3, abs=1e-5)


def test_kernel_is_finite_and_vanishes_for_extreme_weights():
    log_w = torch.tensor([-1e4, -1e30, 60.0, 1e4, 1e30], dtype=torch.float32)
    phi = vespo_kernel(log_w, 2.0, 3.0)
    assert torch.equal(phi, torch.zeros_like(phi))


def test_vespo_gradient_is_minus_phi_times_advantage_with_the_weight_detached():
    b = make_batch(seed=1)
    loss, grad = loss_and_grad("vespo", **b.kwargs())
    mask = b.loss_mask
    log_w_B = ((b.logprobs.detach() - b.old_logprobs) * mask).sum(-1)
    pos = b.advantages >= 0
    c1 = torch.where(pos, torch.tensor(2.0).double(), torch.tensor(3.0).double())
    c2 = torch.where(pos, torch.tensor(3.0).double(), torch.tensor(2.0).double())
    phi_B = torch.exp(c1 * log_w_B + c2 * (1 - log_w_B.exp()))
    n = mask.sum()
    expected_grad = (-(phi_B * b.advantages)[:, None] / n).expand_as(mask) * mask
    torch.testing.assert_close(grad, expected_grad)
    expected_loss = (-(phi_B * b.advantages)[:, None] * b.logprobs.detach() * mask).sum() / n
    torch.testing.assert_close(loss, expected_loss)


@pytest.mark.parametrize(
    "exponents",
    [
        {},  # the paper's (2, 3) / (3, 2): exact in float32 too
        {"c1_pos": 2.1, "c2_pos": 2.9, "c1_neg": 3.3, "c2_neg": 1.7},  # not exact in float32
    ],
)
def test_vespo_float64_matches_closed_form_to_1e_13(exponents):
    """float64 in, float64 math throughout: kernel exponents are not rounded to float32."""
    c = {"c1_pos": 2.0, "c2_pos": 3.0, "c1_neg": 3.0, "c2_neg": 2.0} | exponents
    lp, old, adv, mask = float64_batch(32, 0.05)
    out = compute_policy_loss(
        "vespo",
        **exponents,
        logprobs=lp,
        old_logprobs=old,
        advantages=adv,
        loss_mask=mask,
        loss_agg_mode="seq-mean-token-sum",
        global_num_seqs=1,  # loss = sum of per-token losses, gradient = per-token derivative
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    value, dvalue = [], []
    for lp_row, old_row, a in zip(lp.tolist(), old.tolist(), adv.tolist(), strict=True):
        w = math.exp(sum(x - y for x, y in zip(lp_row, old_row, strict=True)))
        side = "pos" if a >= 0 else "neg"
        phi = _phi(w, c[f"c1_{side}"], c[f"c2_{side}"])
        value.append([-phi * a * x for x in lp_row])
        dvalue.append([-phi * a] * len(lp_row))
    value_t, dvalue_t = (torch.tensor(v, dtype=torch.float64) for v in (value, dvalue))
    torch.testing.assert_close(out.per_token_loss.detach(), value_t, rtol=1e-13, atol=0.0)
    torch.testing.assert_close(grad, dvalue_t, rtol=1e-13, atol=0.0)


def test_vespo_on_policy_gradient_is_plain_reinforce():
    b = make_batch(seed=2, drift=0.0)
    b.logprobs = b.old_logprobs.clone().requires_grad_()
    _, grad = loss_and_grad("vespo", **b.kwargs())
    expected = (-b.advantages[:, None] / b.loss_mask.sum()).expand_as(b.loss_mask) * b.loss_mask
    torch.testing.assert_close(grad, expected)


def test_vespo_is_not_length_normalised():
    """Same mean per-token log-ratio, different lengths: different weights (VESPO, App. E)."""
    old = torch.full((2, 8), -1.0, dtype=torch.float64)
    lp = (old + 0.05).requires_grad_()
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :2] = True
    mask[1, :] = True
    out = compute_policy_loss(
        "vespo",
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.ones(2, dtype=torch.float64),
        loss_mask=mask,
    )
    assert out.metrics["vespo/phi_min"].item() == pytest.approx(_phi(math.exp(0.4), 2, 3))
    assert out.metrics["vespo/phi_max"].item() == pytest.approx(_phi(math.exp(0.1), 2, 3))
