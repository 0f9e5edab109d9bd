"""EPIC: exact reverse-KL bounds, both clip operators (dual, plain), current-token-only gradient.

The reference below follows the paper's equations token by token in plain Python (bisection for
the bounds), independently of the vectorised implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import make_batch

from megatron_rl.losses import compute_policy_loss, get_loss_spec
from megatron_rl.losses.epic import EPICConfig, epic_log_bounds, reverse_kl_roots


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


def _reference(lp, olp, adv, mask, delta_low, delta_high, variant="dual"):
    """Per-token value S_t, d S_t / d log pi_t and the clipping side (+1 above u, -1 below l).

    dual: the paper's Eq. 36; plain: ``min(g A, clip(g, l, u) A)``, i.e. ``A max(g, l)`` for A < 0.
    """
    value, grad, side = torch.zeros_like(lp), torch.zeros_like(lp), torch.zeros_like(lp)
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
                side[i, j] = 1.0 if g >= upper else 0.0
            elif variant == "plain":
                value[i, j] = a * max(g, lower)
                side[i, j] = -1.0 if g <= lower else 0.0
            else:
                value[i, j] = a * min(max(g, lower), upper)
                side[i, j] = 1.0 if g >= upper else (-1.0 if g <= lower else 0.0)
            grad[i, j] = a * g if side[i, j] == 0 else 0.0
    return value, grad, side


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


@pytest.mark.parametrize("variant", ["dual", "plain"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_epic_matches_the_token_by_token_reference(seed, variant):
    b = make_batch(num_seqs=5, max_len=7, seed=seed, drift=0.2)
    dl, dh = 5e-4, 2e-3  # the paper's budgets
    out = compute_policy_loss("epic", delta_low=dl, delta_high=dh, variant=variant, **b.kwargs())
    (grad,) = torch.autograd.grad(out.loss, b.logprobs)
    args = (b.logprobs.detach(), b.old_logprobs, b.advantages.tolist(), b.loss_mask, dl, dh)
    value, dvalue, side = _reference(*args, variant=variant)
    n_B = b.loss_mask.sum(-1, keepdim=True)
    torch.testing.assert_close(out.per_token_loss.detach(), -value)
    torch.testing.assert_close(grad, -dvalue / n_B / b.loss_mask.shape[0])
    clipped = (dvalue == 0) & b.loss_mask
    assert 0 < int(clipped.sum()) < int(b.loss_mask.sum()), "test must exercise both regimes"
    # the metrics count exactly the tokens whose gradient each bound removes
    n_tok = int(b.loss_mask.sum())
    high, low = int((side[b.loss_mask] > 0).sum()), int((side[b.loss_mask] < 0).sum())
    assert out.metrics["epic/clip_frac_high"].item() == pytest.approx(high / n_tok)
    assert out.metrics["epic/clip_frac_low"].item() == pytest.approx(low / n_tok)


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


def test_epic_variants_differ_on_the_reference_batches():
    """The seeds above contain negative-advantage tokens above u (plain and dual disagree)."""
    differ = 0
    for seed in (1, 2):
        b = make_batch(num_seqs=5, max_len=7, seed=seed, drift=0.2)
        args = (b.logprobs.detach(), b.old_logprobs, b.advantages.tolist(), b.loss_mask)
        _, dual, _ = _reference(*args, 5e-4, 2e-3, variant="dual")
        _, plain, _ = _reference(*args, 5e-4, 2e-3, variant="plain")
        differ += int((dual != plain).sum())
    assert differ > 0


def _one_token_rows(variant: str):
    """Rows (A=-1, g > u), (A=-1, g < l), (A=+1, g > u); loss = sum of per-token losses."""
    old = torch.full((3, 1), -1.0, dtype=torch.float64)
    lp = (old + torch.tensor([[0.5], [-0.5], [0.5]], dtype=torch.float64)).requires_grad_()
    out = compute_policy_loss(
        "epic",
        variant=variant,
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64),
        loss_mask=torch.ones(3, 1, dtype=torch.bool),
        loss_agg_mode="seq-mean-token-sum",
        global_num_seqs=1,
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    # t = 1: phi(l) = delta_low / mu, phi(u) = delta_high / mu with mu = e^-1
    x_low, _ = _phi_roots(5e-4 / math.exp(-1.0))
    _, x_up = _phi_roots(2e-3 / math.exp(-1.0))
    lower, upper, g_up, g_low = math.exp(x_low), math.exp(x_up), math.exp(0.5), math.exp(-0.5)
    assert g_up > upper and g_low < lower  # the rows sit where the test says
    return out, grad[:, 0].tolist(), (lower, upper, g_up)


def test_plain_negative_advantage_above_u_keeps_its_gradient_and_dual_cuts_it():
    plain, grad_plain, (lower, upper, g) = _one_token_rows("plain")
    dual, grad_dual, _ = _one_token_rows("dual")
    # A = -1, g > u: plain keeps S = A g and d S / d log pi = A g; dual pins S = A u, no gradient
    assert plain.per_token_loss[0, 0].item() == pytest.approx(g, rel=1e-12)
    assert grad_plain[0] == pytest.approx(g, rel=1e-12)  # d(-S)/d log pi = -A g = g
    assert dual.per_token_loss[0, 0].item() == pytest.approx(upper, rel=1e-9)
    assert grad_dual[0] == 0.0
    # A = -1, g < l: clipped at l by both operators
    for out, grad in ((plain, grad_plain), (dual, grad_dual)):
        assert out.per_token_loss[1, 0].item() == pytest.approx(lower, rel=1e-9)
        assert grad[1] == 0.0
        # A = +1, g > u: clipped at u by both operators
        assert out.per_token_loss[2, 0].item() == pytest.approx(-upper, rel=1e-9)
        assert grad[2] == 0.0
        assert out.metrics["epic/clip_frac_low"].item() == pytest.approx(1 / 3)
    assert plain.metrics["epic/clip_frac_high"].item() == pytest.approx(1 / 3)
    assert dual.metrics["epic/clip_frac_high"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_variant_is_finite_for_huge_prefix_ratios(dtype):
    old = torch.full((2, 8), -40.0, dtype=dtype)
    lp = torch.full((2, 8), -0.01, dtype=dtype, requires_grad=True)
    out = compute_policy_loss(
        "epic",
        variant="plain",
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -1.0], dtype=dtype),
        loss_mask=torch.ones(2, 8, dtype=torch.bool),
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert (grad[0] == 0).all() and (grad[1] > 0).all()  # A = -1 above u keeps its gradient


def test_epic_variant_defaults_to_dual_and_the_registry_builds_plain():
    spec = get_loss_spec("epic")
    assert spec.make_config({}).variant == "dual"
    assert spec.make_config({"variant": "plain"}) == EPICConfig(variant="plain")


@pytest.mark.parametrize("bad", ["clipped", "Plain", None, 1.0])
def test_invalid_epic_variant_names_the_field_the_value_and_the_choices(bad):
    expected = rf"variant={bad!r} is unknown; choose one of \('dual', 'plain'\)"
    with pytest.raises(ValueError, match=expected):
        get_loss_spec("epic").make_config({"variant": bad})
    b = make_batch(seed=3)
    with pytest.raises(ValueError, match=expected):
        compute_policy_loss("epic", variant=bad, **b.kwargs())
