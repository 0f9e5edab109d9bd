"""EPIC: exact reverse-KL bounds, sign-aware clip, current-token-only gradient.

The reference below follows the paper's equations token by token in plain Python (bisection for
the bounds), independently of the vectorised implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import make_batch

from megatron_rl.losses import compute_policy_loss
from megatron_rl.losses.epic import epic_log_bounds, reverse_kl_roots


def _bisect(f, lo: float, hi: float) -> float:
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if (f(mid) > 0) == (f(lo) > 0):
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _phi_roots(c: float) -> tuple[float, float]:
    """Roots in log space of exp(x) - 1 - x = c, by bisection."""

    def h(x: float) -> float:
        return math.expm1(x) - x - c

    return _bisect(h, -(c + 2.0), 0.0), _bisect(h, 0.0, math.log(c + 2.0) + 2.0)


def _reference(lp, olp, adv, mask, delta_low, delta_high):
    """Per-token value S_t and d S_t / d log pi_t (EPIC Eq. 36), sequence by sequence."""
    value, grad = torch.zeros_like(lp), torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        t, prefix, sum_log_mu = 0, 0.0, 0.0
        for j in range(lp.shape[1]):
            if not mask[i, j]:
                continue
            t += 1
            prefix += lp[i, j] - olp[i, j]
            sum_log_mu += olp[i, j]
            mu_geo = math.exp(sum_log_mu / t)
            x_low, _ = _phi_roots(t * delta_low / mu_geo)
            _, x_up = _phi_roots(t * delta_high / mu_geo)
            lower, upper, g = math.exp(x_low / t), math.exp(x_up / t), math.exp(prefix / t)
            a = adv[i]
            if a >= 0:
                value[i, j] = a * min(g, upper)
                grad[i, j] = a * g if g < upper else 0.0
            else:
                value[i, j] = a * min(max(g, lower), upper)
                grad[i, j] = a * g if lower < g < upper else 0.0
    return value, grad


@pytest.mark.parametrize("c", [1e-9, 1e-4, 0.3, 1.0, 2.0, 7.5, 1e3, 1e8])
def test_reverse_kl_roots_solve_the_bound_equation(c):
    x_low, x_up = reverse_kl_roots(torch.tensor([math.log(c)], dtype=torch.float64))
    ref_low, ref_up = _phi_roots(c)
    assert x_low.item() == pytest.approx(ref_low, rel=1e-9)
    assert x_up.item() == pytest.approx(ref_up, rel=1e-9)
    assert x_low.item() <= 0.0 <= x_up.item()


def test_bounds_widen_with_the_budget_and_approach_one_as_it_vanishes():
    olp = torch.full((1, 5), -1.0, dtype=torch.float64)
    mask = torch.ones(1, 5, dtype=torch.bool)
    lo_small, up_small, _ = epic_log_bounds(olp, mask, 1e-8, 1e-8)
    lo_big, up_big, _ = epic_log_bounds(olp, mask, 1e-2, 1e-2)
    assert (lo_big < lo_small).all() and (up_big > up_small).all()
    assert lo_small.abs().max() < 1e-3 and up_small.abs().max() < 1e-3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_epic_matches_the_token_by_token_reference(seed):
    b = make_batch(num_seqs=5, max_len=7, seed=seed, drift=0.2)
    dl, dh = 5e-4, 2e-3  # the paper's budgets
    out = compute_policy_loss("epic", delta_low=dl, delta_high=dh, **b.kwargs())
    (grad,) = torch.autograd.grad(out.loss, b.logprobs)
    value, dvalue = _reference(
        b.logprobs.detach(), b.old_logprobs, b.advantages.tolist(), b.loss_mask, dl, dh
    )
    n_B = b.loss_mask.sum(-1, keepdim=True)
    torch.testing.assert_close(out.per_token_loss.detach(), -value)
    torch.testing.assert_close(grad, -dvalue / n_B / b.loss_mask.shape[0])
    clipped = (dvalue == 0) & b.loss_mask
    assert 0 < int(clipped.sum()) < int(b.loss_mask.sum()), "test must exercise both regimes"


def test_epic_gradient_reaches_only_the_current_token():
    b = make_batch(num_seqs=2, max_len=6, seed=5, drift=0.01)
    kw = b.kwargs()

    def per_token(lp):
        return compute_policy_loss("epic", **(kw | {"logprobs": lp}), delta_high=1.0).per_token_loss

    jac = torch.autograd.functional.jacobian(per_token, b.logprobs.detach())  # [B,T,B,T]
    eye = torch.eye(2 * 6, dtype=torch.bool).reshape(2, 6, 2, 6)
    assert jac[~eye].abs().max().item() == 0.0
    assert jac[eye].abs().sum().item() > 0.0


def test_negative_advantage_below_lower_bound_gets_no_gradient_but_positive_does():
    # one token, ratio far below any lower bound
    old = torch.tensor([[-1.0], [-1.0]], dtype=torch.float64)
    lp = torch.tensor([[-3.0], [-3.0]], dtype=torch.float64, requires_grad=True)
    out = compute_policy_loss(
        "epic",
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -1.0]).double(),
        loss_mask=torch.ones(2, 1, dtype=torch.bool),
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad[0, 0].item() == pytest.approx(-math.exp(-2.0) / 2)
    assert grad[1, 0].item() == 0.0
