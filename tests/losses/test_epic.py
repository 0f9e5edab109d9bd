"""EPIC: exact reverse-KL bounds, both clip operators (dual, plain), the two ablations of the
paper's Table 3 (raw-prob, cumulative-ratio), current-token-only gradient.

The reference below follows the paper's equations token by token in plain Python (bisection for
the bounds), independently of the vectorised implementation.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import make_batch

from megatron_rl.losses import compute_policy_loss, get_loss_spec
from megatron_rl.losses.epic import EPIC_VARIANTS, EPICConfig, epic_log_bounds, reverse_kl_roots


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
    Table 3: raw-prob calibrates with ``mu(y_1:t)`` instead of ``mu(y_1:t)^(1/t)``;
    cumulative-ratio clips ``r_pre`` itself to ``[l, u]``. Both use Eq. 36's operator.
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
            mu_cal = math.exp(sum_log_mu if variant == "raw-prob" else sum_log_mu / t)
            x_low, _ = _phi_roots(t * delta_low / mu_cal)
            _, x_up = _phi_roots(t * delta_high / mu_cal)
            if variant == "cumulative-ratio":  # r_pre against [l_t, u_t]
                lower, upper, g = math.exp(x_low), math.exp(x_up), math.exp(prefix)
            else:  # g_t against [l_t^(1/t), u_t^(1/t)]
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


@pytest.mark.parametrize("variant", EPIC_VARIANTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_epic_matches_the_token_by_token_reference(seed, variant):
    b = make_batch(num_seqs=5, max_len=7, seed=seed, drift=0.2)
    dl, dh = 5e-4, 2e-3  # the paper's budgets
    out = compute_policy_loss("epic", delta_low=dl, delta_high=dh, variant=variant, **b.kwargs())
    (grad,) = torch.autograd.grad(out.loss, b.logprobs)
    args = (b.logprobs.detach(), b.old_logprobs, b.advantages.tolist(), b.loss_mask, dl, dh)
    value, dvalue, side = _reference(*args, variant=variant)
    n_B = b.loss_mask.sum(-1, keepdim=True)
    torch.testing.assert_close(out.per_token_loss.detach(), -value, rtol=1e-9, atol=1e-12)
    expected_grad = -dvalue / n_B / b.loss_mask.shape[0]
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
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


def test_epic_variant_defaults_to_dual_and_the_registry_builds_every_variant():
    spec = get_loss_spec("epic")
    assert spec.make_config({}).variant == "dual"
    assert EPIC_VARIANTS == ("dual", "plain", "raw-prob", "cumulative-ratio")
    for variant in EPIC_VARIANTS:
        assert spec.make_config({"variant": variant}) == EPICConfig(variant=variant)


@pytest.mark.parametrize("bad", ["clipped", "Plain", "raw_prob", None, 1.0])
def test_invalid_epic_variant_names_the_field_the_value_and_the_choices(bad):
    choices = r"\('dual', 'plain', 'raw-prob', 'cumulative-ratio'\)"
    expected = rf"variant={bad!r} is unknown; choose one of {choices}"
    with pytest.raises(ValueError, match=expected):
        get_loss_spec("epic").make_config({"variant": bad})
    b = make_batch(seed=3)
    with pytest.raises(ValueError, match=expected):
        compute_policy_loss("epic", variant=bad, **b.kwargs())


def test_cumulative_ratio_value_is_the_prefix_ratio_and_its_gradient_the_current_tokens():
    # mu = 1 and pi / mu = 2 per token: r_pre = 2, 4, 8 (g_t would be 2, 2, 2); huge budgets
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.full((1, 3), math.log(2.0), dtype=torch.float64, requires_grad=True)
    kwargs = dict(old_logprobs=old, advantages=torch.tensor([1.0], dtype=torch.float64))
    kwargs |= dict(loss_mask=torch.ones(1, 3, dtype=torch.bool), delta_low=1e3, delta_high=1e3)
    out = compute_policy_loss("epic", variant="cumulative-ratio", logprobs=lp, **kwargs)
    jac = torch.autograd.functional.jacobian(
        lambda x: (
            compute_policy_loss(
                "epic", variant="cumulative-ratio", logprobs=x, **kwargs
            ).per_token_loss
        ),
        lp.detach(),
    )[0, :, 0, :]
    assert out.per_token_loss[0].tolist() == pytest.approx([-2.0, -4.0, -8.0], rel=1e-12)
    expected = torch.diag(torch.tensor([-2.0, -4.0, -8.0], dtype=torch.float64))
    torch.testing.assert_close(jac, expected, rtol=1e-12, atol=0)
    dual = compute_policy_loss("epic", logprobs=lp, **kwargs)
    assert dual.per_token_loss[0].tolist() == pytest.approx([-2.0, -2.0, -2.0], rel=1e-12)


def test_cumulative_ratio_clips_the_same_tokens_as_dual_at_the_undivided_bounds():
    """``r_pre >= u_t`` iff ``g_t >= u_t^(1/t)``: the ablation changes the value, not the events;
    a clipped token's loss is ``-A u_t`` (or ``-A l_t``), the ``t``-th power of dual's."""
    b = make_batch(num_seqs=6, max_len=9, seed=4, drift=0.2)
    dual = compute_policy_loss("epic", **b.kwargs())
    cum = compute_policy_loss("epic", variant="cumulative-ratio", **b.kwargs())
    for key in ("epic/clip_frac_high", "epic/clip_frac_low"):
        assert cum.metrics[key].item() == dual.metrics[key].item()
    for k in range(10):
        key = f"policy/clip_pos_clipped_{k}"
        assert cum.metrics[key].item() == dual.metrics[key].item()
    assert dual.metrics["epic/clip_frac_high"].item() > 0
    (g_dual,) = torch.autograd.grad(dual.loss, b.logprobs)
    (g_cum,) = torch.autograd.grad(cum.loss, b.logprobs)
    clipped = (g_dual == 0) & b.loss_mask
    assert torch.equal(clipped, (g_cum == 0) & b.loss_mask) and bool(clipped.any())
    t = torch.cumsum(b.loss_mask.double(), -1)
    adv = b.advantages[:, None].expand_as(t)
    bound_dual = dual.per_token_loss.detach() / -adv  # l^(1/t) or u^(1/t)
    bound_cum = cum.per_token_loss.detach() / -adv  # l or u
    torch.testing.assert_close(
        bound_cum[clipped], bound_dual[clipped] ** t[clipped], rtol=1e-9, atol=0
    )


@pytest.mark.parametrize("variant", ["raw-prob", "cumulative-ratio"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ablations_are_finite_for_extreme_prefix_ratios(variant, dtype, sign):
    # |L_t| up to 40 * 64 = 2560: r_pre and 1 / mu(y_1:t) far beyond float64 (log c up to 2560)
    old = torch.full((2, 64), -40.0, dtype=dtype)
    lp = (old + sign * 39.99).clamp(max=0.0) if sign > 0 else torch.full_like(old, -80.0)
    lp = lp.requires_grad_()
    out = compute_policy_loss(
        "epic",
        variant=variant,
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([1.0, -1.0], dtype=dtype),
        loss_mask=torch.ones(2, 64, dtype=torch.bool),
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.per_token_loss).all() and torch.isfinite(grad).all()
    assert out.per_token_loss.abs().max().item() <= math.exp(20.0) * (1 + 1e-6)
    for value in out.metrics.values():
        assert torch.isfinite(value).all()


def test_raw_prob_tests_its_bound_past_the_float_range_of_the_prefix_ratio():
    """log mu = -40, log pi = -1: L_t = 39 t and log c = log t + log delta + 40 t, so
    ``x_up ~ log c`` and the upper bound holds exactly for t <= 4 (4 < 6.21 - log 4, 5 > 6.21 - log
    5 with -log delta = 6.21); from t = 19 on, ``e^L_t`` overflows float64."""
    old = torch.full((1, 30), -40.0, dtype=torch.float64)
    lp = torch.full((1, 30), -1.0, dtype=torch.float64, requires_grad=True)
    out = compute_policy_loss(
        "epic",
        variant="raw-prob",
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.tensor([1.0], dtype=torch.float64),
        loss_mask=torch.ones(1, 30, dtype=torch.bool),
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    clipped = (grad[0] == 0).tolist()
    assert clipped == [True] * 4 + [False] * 26
    assert out.metrics["epic/clip_frac_high"].item() == pytest.approx(4 / 30)


def _long_batch(num_seqs: int = 64, length: int = 512, sigma: float = 0.1, seed: int = 0):
    """Full-length responses, log mu uniform in [-2.05, -0.05], token log-ratios N(0, sigma^2)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_seqs, length)
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 0.05
    lp = old + sigma * torch.randn(shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(num_seqs, generator=gen, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    return dict(logprobs=lp.requires_grad_(), old_logprobs=old, advantages=adv, loss_mask=mask)


def _profile(variant: str, batch: dict) -> tuple[list[float], float, float, int]:
    """Per-bin clip fractions, position CV, overall clip fraction, last clipped position."""
    out = compute_policy_loss("epic", variant=variant, **batch)
    fracs = [out.metrics[f"policy/clip_frac_pos_{k}"].item() for k in range(10)]
    total = out.metrics["epic/clip_frac_high"] + out.metrics["epic/clip_frac_low"]
    (grad,) = torch.autograd.grad(out.loss, batch["logprobs"])
    last = int((grad == 0).nonzero()[:, 1].max())  # advantages are nonzero: grad 0 = clipped
    return fracs, out.metrics["policy/clip_position_cv"].item(), total.item(), last


def test_raw_prob_clips_only_the_start_of_long_responses_and_dual_clips_evenly():
    """Paper App. 10.4 / Fig. 3(c): with Raw-prob calibration the clip acts almost only in the
    first relative-position bin; the default keeps every bin clipped at a similar rate."""
    batch = _long_batch()
    dual_fracs, dual_cv, dual_total, dual_last = _profile("dual", batch)
    raw_fracs, raw_cv, raw_total, raw_last = _profile("raw-prob", batch)
    # dual (measured: bin fractions 0.34-0.47, CV 0.098, 38% clipped): every bin, near the mean
    assert min(dual_fracs) > 0.3 and dual_cv < 0.15 and dual_last == 511
    # raw-prob (measured: 0.0147 in bin 0 and 0 elsewhere, CV = sqrt(K - 1) = 3, 0.15% clipped,
    # the last clipped token at position 4 of 512)
    assert raw_fracs[0] > 0 and raw_fracs[1:] == [0.0] * 9
    assert raw_cv == pytest.approx(3.0)
    assert raw_total < dual_total / 100 and raw_last < 16
    lo, up, _ = epic_log_bounds(batch["old_logprobs"], batch["loss_mask"], 5e-4, 2e-3, "raw-prob")
    # past the start its bounds on g_t are ~[0, 1 / geometric-mean mu]: effectively no clip
    assert lo[:, 64:].exp().max().item() < 1e-10 and up[:, 64:].exp().min().item() > 1.5


@pytest.mark.parametrize("variant", EPIC_VARIANTS)
def test_a_masked_out_token_inside_a_response_leaves_every_prefix_as_if_it_were_absent(variant):
    # a tool output inside a multi-turn response (response_mask 0), with arbitrary log-probs
    # there: the prefix ratio, its budget and t must skip it, as if the token were not there
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(1, 6, generator=gen, dtype=torch.float64) * 3
    lp = old + torch.randn(1, 6, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.tensor([[True, True, False, False, True, True]])
    lp[0, 2:4], old[0, 2:4] = torch.tensor([-40.0, 5.0]), torch.tensor([3.0, -60.0])
    keep = mask[0]
    common = dict(advantages=torch.tensor([-1.0], dtype=torch.float64), variant=variant)
    common |= dict(delta_low=0.05, delta_high=0.05, loss_agg_mode="token-mean")
    with_gap = compute_policy_loss(
        "epic", logprobs=lp, old_logprobs=old, loss_mask=mask, **common
    ).per_token_loss[0, keep]
    without = compute_policy_loss(
        "epic",
        logprobs=lp[:, keep],
        old_logprobs=old[:, keep],
        loss_mask=torch.ones(1, 4, dtype=torch.bool),
        **common,
    ).per_token_loss[0]
    torch.testing.assert_close(with_gap, without, rtol=1e-12, atol=0)
