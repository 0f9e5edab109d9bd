"""CTPO: cumulative token ratio, position-adaptive log-space bounds, dual clip, current-token
gradient; exact against a token-by-token reference, finite under extreme staleness.

The reference transcribes the objective token by token with torch scalars (autograd gives its
gradient): ``rho_t = exp(sum_{k<t} sg[log r_k] + log r_t)``,
``S_t = min(rho A, clip(rho, e^(-cl t^p), e^(ch t^p)) A)``, for ``A < 0`` also
``S_t = max(S_t, A e^(c t^p))``, loss = ``-mean_i mean_t S_t``. It shares no code with
``megatron_rl.losses.ctpo``.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.losses import compute_policy_loss, get_loss_spec
from megatron_rl.losses.ctpo import CTPOConfig
from megatron_rl.losses.layout import prepare_inputs
from megatron_rl.train.config import TrainConfig, build_parser, parse_args

PAPER = dict(clip_low=0.025, clip_high=0.05, log_clip_c=0.05, position_power=0.5)


def _reference(lp, olp, adv, mask, clip_low, clip_high, log_clip_c, position_power):
    """Loss (seq-mean-token-mean), its gradient, and per token: clipped (the reference's own
    gradient is 0 with A != 0) and the sign of the prefix log-ratio."""
    lp = lp.detach().clone().requires_grad_()
    seq_losses = []
    prefix_sign = torch.zeros(lp.shape)
    for i in range(lp.shape[0]):
        terms, past, t = [], 0.0, 0
        for j in range(lp.shape[1]):
            if not mask[i][j]:
                continue
            t += 1
            a = float(adv[i][j])
            x = lp[i, j] - float(olp[i][j])
            rho = torch.exp(past + x)  # earlier tokens detached, the current one live
            scale = t**position_power
            lower, upper = math.exp(-clip_low * scale), math.exp(clip_high * scale)
            s = torch.minimum(rho * a, torch.clamp(rho, lower, upper) * a)
            if a < 0:  # exp(inf) = inf: no dual clip
                s = torch.clamp(s, min=a * math.exp(log_clip_c * scale))
            terms.append(-s)
            past += x.item()
            prefix_sign[i, j] = math.copysign(1.0, past)
        if terms:
            seq_losses.append(torch.stack(terms).mean())
    loss = torch.stack(seq_losses).mean()
    (grad,) = torch.autograd.grad(loss, lp)
    adv_nonzero = torch.as_tensor(adv) != 0
    clipped = mask & adv_nonzero & (grad == 0)
    return loss.detach(), grad, clipped, prefix_sign


def _batch(seed, B=6, T=12, drift=0.2, holes=True, per_token_adv=False):
    """float64 batch; masks with gaps inside responses (multi-turn tool output) when ``holes``."""
    gen = torch.Generator().manual_seed(seed)
    olp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    lp = (olp + drift * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    if holes:
        mask &= torch.rand(B, T, generator=gen) > 0.25
        mask[:, 0] = True
    if per_token_adv:
        adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    else:
        adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return lp.requires_grad_(), olp, adv, mask


def _clipped_map(name, lp, olp, adv, mask, **hyper):
    spec = get_loss_spec(name)
    inputs, _ = prepare_inputs(lp.detach(), olp, adv, mask, None, True)
    return spec.fn(inputs, spec.make_config(hyper)).clipped_BT


@pytest.mark.parametrize(
    "hyper",
    [
        PAPER,
        dict(PAPER, log_clip_c=math.inf),
        dict(clip_low=0.1, clip_high=0.2, log_clip_c=0.3, position_power=0.3),
        dict(clip_low=0.05, clip_high=0.08, log_clip_c=0.02, position_power=0.0),
    ],
    ids=["paper", "no-dual", "custom", "uniform-dual-below-upper"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_ctpo_matches_the_token_by_token_reference(hyper, seed, per_token_adv):
    lp, olp, adv, mask = _batch(seed, per_token_adv=per_token_adv)
    out = compute_policy_loss(
        "ctpo", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask, **hyper
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    adv_BT = adv if per_token_adv else adv[:, None].expand_as(mask)
    ref_loss, ref_grad, ref_clipped, sign = _reference(lp, olp, adv_BT, mask, **hyper)
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)

    clipped = _clipped_map("ctpo", lp, olp, adv, mask, **hyper)
    assert torch.equal(clipped, ref_clipped)
    n = int(mask.sum())
    high = ref_clipped & (sign > 0) & (adv_BT > 0)
    dual = ref_clipped & (sign > 0) & (adv_BT < 0)
    low = ref_clipped & (sign < 0)
    assert int(high.sum()) > 0 and int(low.sum()) > 0, "both clip sides must be active"
    assert int((mask & ~ref_clipped).sum()) > 0, "some tokens must keep their gradient"
    assert out.metrics["ctpo/clip_frac_high"].item() == pytest.approx(int(high.sum()) / n)
    assert out.metrics["ctpo/clip_frac_low"].item() == pytest.approx(int(low.sum()) / n)
    assert out.metrics["ctpo/dual_clip_frac"].item() == pytest.approx(int(dual.sum()) / n)
    if math.isinf(hyper["log_clip_c"]):
        assert int(dual.sum()) == 0
    elif hyper == PAPER:
        assert int(dual.sum()) > 0, "the dual clip must be exercised"


def test_position_counts_only_masked_tokens_and_bounds_grow_like_sqrt_t():
    """Hand-made: constant log-ratio 0.04 per response token, a masked-out gap in the middle.
    L_t = 0.04 t crosses u_t = 0.05 sqrt(t) above t = 1.5625, so tokens 2.. are clipped (A > 0)
    with value exp(0.05 sqrt(t)); the gap moves neither t nor L_t."""
    T = 6
    olp = torch.full((1, T), -1.0, dtype=torch.float64)
    lp = (olp + 0.04).requires_grad_()
    mask = torch.tensor([[True, True, False, False, True, True]])
    out = compute_policy_loss(
        "ctpo",
        logprobs=lp,
        old_logprobs=olp,
        advantages=torch.ones(1, dtype=torch.float64),
        loss_mask=mask,
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    expected = [-math.exp(0.04), -math.exp(0.05 * math.sqrt(2)), 0.0, 0.0]
    expected += [-math.exp(0.05 * math.sqrt(3)), -math.exp(0.05 * math.sqrt(4))]
    torch.testing.assert_close(out.per_token_loss.detach()[0], torch.tensor(expected).double())
    assert grad[0, 0].item() == pytest.approx(-math.exp(0.04) / 4)
    assert torch.equal(grad[0, 1:], torch.zeros(T - 1, dtype=torch.float64))


def test_gradient_reaches_only_the_current_token():
    lp, olp, adv, mask = _batch(3, B=2, T=5, drift=0.002, holes=False)
    mask[:] = True

    def per_token(x):
        return compute_policy_loss(
            "ctpo", logprobs=x, old_logprobs=olp, advantages=adv, loss_mask=mask
        ).per_token_loss

    jac = torch.autograd.functional.jacobian(per_token, lp.detach())  # [B, T, B, T]
    diag = torch.zeros_like(jac)
    for i in range(2):
        for j in range(5):
            diag[i, j, i, j] = jac[i, j, i, j]
    assert torch.equal(jac, diag)
    assert (diag.abs().sum() > 0).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("log_ratio", [50.0, -50.0, 1e4, -1e4])
@pytest.mark.parametrize("log_clip_c", [0.05, math.inf])
def test_extreme_staleness_on_4k_tokens_is_finite_and_clips_as_expected(
    dtype, log_ratio, log_clip_c
):
    T = 4096
    base = -torch.rand(2, T, generator=torch.Generator().manual_seed(0), dtype=dtype)
    lp, olp = (base, base - log_ratio) if log_ratio > 0 else (base + log_ratio, base)
    lp = lp.clone().requires_grad_()
    mask = torch.ones(2, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    out = compute_policy_loss(
        "ctpo", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask, log_clip_c=log_clip_c
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    sqrt_t = torch.arange(1, T + 1, dtype=torch.float64).sqrt()
    per_token = out.per_token_loss.detach().double()
    if log_ratio > 0:  # A > 0 sits at the upper bound; A < 0 at the dual cap or the 1e20-ish cap
        torch.testing.assert_close(per_token[0], -(0.05 * sqrt_t).exp(), rtol=1e-5, atol=0)
        assert torch.equal(grad[0], torch.zeros_like(grad[0]))
        if not math.isinf(log_clip_c):
            torch.testing.assert_close(per_token[1], (0.05 * sqrt_t).exp(), rtol=1e-5, atol=0)
            assert torch.equal(grad[1], torch.zeros_like(grad[1]))
    else:  # A > 0 keeps a vanishing ratio; A < 0 sits at the lower bound
        assert per_token[0].abs().max() < 1e-20
        torch.testing.assert_close(per_token[1], (-0.025 * sqrt_t).exp(), rtol=1e-5, atol=0)
        assert torch.equal(grad[1], torch.zeros_like(grad[1]))


def test_fully_masked_rows_change_nothing_and_get_no_gradient():
    lp, olp, adv, mask = _batch(4)
    out_full = compute_policy_loss(
        "ctpo", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask
    )
    lp2 = torch.cat([lp.detach(), torch.full((1, lp.shape[1]), float("nan"))]).requires_grad_()
    olp2 = torch.cat([olp, torch.full((1, lp.shape[1]), float("inf"))])
    adv2 = torch.cat([adv, torch.tensor([5.0], dtype=adv.dtype)])
    mask2 = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])
    out = compute_policy_loss(
        "ctpo", logprobs=lp2, old_logprobs=olp2, advantages=adv2, loss_mask=mask2
    )
    (grad,) = torch.autograd.grad(out.loss, lp2)
    torch.testing.assert_close(out.loss, out_full.loss, rtol=1e-12, atol=0)
    assert torch.equal(grad[-1], torch.zeros_like(grad[-1]))
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("clip_low", 0.0),
        ("clip_low", -0.1),
        ("clip_low", float("nan")),
        ("clip_high", 0.0),
        ("clip_high", float("inf")),
        ("log_clip_c", 0.0),
        ("log_clip_c", float("nan")),
        ("log_clip_c", None),
        ("position_power", float("inf")),
        ("position_power", float("nan")),
        ("clip_high", "0.05"),
    ],
)
def test_bad_hyperparameters_are_refused_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        CTPOConfig(**{field: bad})


def test_defaults_are_the_official_ones():
    assert CTPOConfig() == CTPOConfig(**PAPER)
    assert get_loss_spec("ctpo").default_agg_mode == "seq-mean-token-mean"


def test_every_hyperparameter_is_a_trainer_flag():
    config = TrainConfig.from_flags(
        loss="ctpo", clip_low=0.03, clip_high=0.06, log_clip_c=0.1, position_power=0.4
    )
    expected = CTPOConfig(clip_low=0.03, clip_high=0.06, log_clip_c=0.1, position_power=0.4)
    assert config.objective.loss_config == expected
    argv = "--loss ctpo --clip-low 0.025 --clip-high 0.05 --log-clip-c inf --position-power 0"
    parsed = parse_args(argv.split()).objective.loss_config
    assert parsed == CTPOConfig(
        clip_low=0.025, clip_high=0.05, log_clip_c=math.inf, position_power=0
    )
    assert parse_args(["--loss", "ctpo"]).objective.loss_config == CTPOConfig()
    help_text = build_parser().format_help()
    assert "--log-clip-c" in help_text and "--position-power" in help_text
    with pytest.raises(ValueError, match="--delta-low is not a hyperparameter of --loss ctpo"):
        parse_args(["--loss", "ctpo", "--delta-low", "0.1"])
    with pytest.raises(ValueError, match="clip_low"):
        parse_args(["--loss", "ctpo", "--clip-low", "-1"])
