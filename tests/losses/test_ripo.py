"""RIPO: token-level PPO clip with Riemannian Isometric Clip bounds ``1 -+ sqrt(delta / mu)``
inside the ``[0.5, 10]`` ratio truncation; exact against a token-by-token reference, finite
under extreme staleness and for vanishing behaviour probabilities.

The reference transcribes the objective token by token with torch scalars in ratio space
(autograd gives its gradient): ``r~ = clip(r, 0.5, 10)``, ``l = max(1 - sqrt(dl / mu), 0.5)``,
``u = min(1 + sqrt(dh / mu), 10)``, ``S_t = min(r~ A, clip(r~, l, u) A)``, loss =
``-sum S_t / N_tokens``. It shares no code with ``megatron_rl.losses.ripo``.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.losses import compute_policy_loss, get_loss_spec
from megatron_rl.losses.layout import prepare_inputs
from megatron_rl.losses.ripo import RIPOConfig
from megatron_rl.train.config import TrainConfig, build_parser, parse_args

PAPER = dict(delta_low=0.05, delta_high=0.05, ratio_min=0.5, ratio_max=10.0)


def _reference(lp, olp, adv, mask, delta_low, delta_high, ratio_min, ratio_max):
    """Loss (token-mean), its gradient, and per token: clipped (the reference's own gradient is
    0 with A != 0) and the ratio's side of 1."""
    lp = lp.detach().clone().requires_grad_()
    terms = []
    side = torch.zeros(lp.shape)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if not mask[i][j]:
                continue
            a, mu = float(adv[i][j]), math.exp(float(olp[i][j]))
            r = torch.exp(lp[i, j] - float(olp[i][j]))
            r_trunc = torch.clamp(r, ratio_min, ratio_max)
            lower = max(1.0 - math.sqrt(delta_low / mu), ratio_min)
            upper = min(1.0 + math.sqrt(delta_high / mu), ratio_max)
            s = torch.minimum(r_trunc * a, torch.clamp(r_trunc, lower, upper) * a)
            terms.append(-s)
            side[i, j] = math.copysign(1.0, r.item() - 1.0)
    loss = torch.stack(terms).sum() / len(terms)
    (grad,) = torch.autograd.grad(loss, lp)
    clipped = mask & (torch.as_tensor(adv) != 0) & (grad == 0)
    return loss.detach(), grad, clipped, side


def _batch(seed, B=6, T=12, drift=0.9, per_token_adv=False):
    """float64; behaviour log-probs in [-6, -0.01] (so sqrt(delta / mu) spans 0.2 .. 4.5) and
    log-ratios ~ N(0, drift^2): every bound and both truncations are reached."""
    gen = torch.Generator().manual_seed(seed)
    olp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 6 - 0.01
    lp = olp + drift * torch.randn(B, T, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    mask &= torch.rand(B, T, generator=gen) > 0.2
    mask[:, 0] = True
    if per_token_adv:
        adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    else:
        adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return lp.requires_grad_(), olp, adv, mask


def _clipped_map(lp, olp, adv, mask, **hyper):
    spec = get_loss_spec("ripo")
    inputs, _ = prepare_inputs(lp.detach(), olp, adv, mask, None, True)
    return spec.fn(inputs, spec.make_config(hyper)).clipped_BT


@pytest.mark.parametrize(
    "hyper",
    [
        PAPER,
        dict(PAPER, delta_low=0.02, delta_high=0.08),
        dict(PAPER, ratio_min=0.0, ratio_max=math.inf),
        dict(delta_low=0.2, delta_high=0.01, ratio_min=0.3, ratio_max=3.0),
    ],
    ids=["paper", "asymmetric", "no-truncation", "custom"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_ripo_matches_the_token_by_token_reference(hyper, seed, per_token_adv):
    lp, olp, adv, mask = _batch(seed, per_token_adv=per_token_adv)
    out = compute_policy_loss(
        "ripo", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask, **hyper
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    adv_BT = adv if per_token_adv else adv[:, None].expand_as(mask)
    ref_loss, ref_grad, ref_clipped, side = _reference(lp, olp, adv_BT, mask, **hyper)
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)

    assert torch.equal(_clipped_map(lp, olp, adv, mask, **hyper), ref_clipped)
    n = int(mask.sum())
    high, low = ref_clipped & (side > 0), ref_clipped & (side < 0)
    assert int(high.sum()) > 0 and int(low.sum()) > 0, "both clip sides must be active"
    assert int((mask & ~ref_clipped).sum()) > 0, "some tokens must keep their gradient"
    assert out.metrics["ripo/clip_frac_high"].item() == pytest.approx(int(high.sum()) / n)
    assert out.metrics["ripo/clip_frac_low"].item() == pytest.approx(int(low.sum()) / n)
    ratio = (lp.detach() - olp).exp()
    truncated = mask & (
        ((adv_BT > 0) & (ratio < hyper["ratio_min"]))
        | ((adv_BT < 0) & (ratio > hyper["ratio_max"]))
    )
    assert out.metrics["ripo/truncated_frac"].item() == pytest.approx(int(truncated.sum()) / n)
    if hyper == PAPER:
        assert int(truncated.sum()) > 0, "the [0.5, 10] truncation must be exercised"


def test_isometric_bounds_on_hand_made_tokens():
    """delta = 0.02 as in the paper's example: mu = 0.8 allows r up to 1 + sqrt(0.025) = 1.158,
    mu = 0.01 up to 1 + sqrt(2) = 2.414; both spend the same 1/2 mu (r - 1)^2 = 0.01."""
    mu = torch.tensor([[0.8, 0.01, 0.8, 0.01]], dtype=torch.float64)
    ratio = torch.tensor([[1.2, 2.0, 0.8, 0.3]], dtype=torch.float64)
    olp = mu.log()
    lp = (olp + ratio.log()).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    out = compute_policy_loss(
        "ripo",
        logprobs=lp,
        old_logprobs=olp,
        advantages=adv,
        loss_mask=torch.ones(1, 4, dtype=torch.bool),
        delta_low=0.02,
        delta_high=0.02,
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    # u(0.8) = 1.158 clips r = 1.2; r = 2.0 < u(0.01) keeps its gradient; l(0.8) = 0.842 clips
    # r = 0.8 (A < 0); l(0.01) = 1 - 1.414 < 0 gives l = 0.5, which clips r = 0.3 (A < 0)
    expected = [-(1 + math.sqrt(0.025)), -2.0, 1 - math.sqrt(0.025), 0.5]
    torch.testing.assert_close(out.per_token_loss.detach()[0], torch.tensor(expected).double())
    torch.testing.assert_close(grad[0], torch.tensor([0.0, -2.0 / 4, 0.0, 0.0]).double())
    for mu_, bound in ((0.8, math.sqrt(0.025)), (0.01, math.sqrt(2.0))):
        assert 0.5 * mu_ * bound**2 == pytest.approx(0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("log_ratio", [50.0, -50.0, 1e4, -1e4])
@pytest.mark.parametrize("ratio_max", [10.0, math.inf])
def test_extreme_staleness_on_4k_tokens_is_finite(dtype, log_ratio, ratio_max):
    T = 4096
    base = -torch.rand(2, T, generator=torch.Generator().manual_seed(0), dtype=dtype)
    lp, olp = (base, base - log_ratio) if log_ratio > 0 else (base + log_ratio, base)
    lp = lp.clone().requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    out = compute_policy_loss(
        "ripo",
        logprobs=lp,
        old_logprobs=olp,
        advantages=adv,
        loss_mask=torch.ones(2, T, dtype=torch.bool),
        ratio_max=ratio_max,
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    per_token = out.per_token_loss.detach().double()
    if log_ratio > 0:  # mu ~ e^-50 or less: u = ratio_max (capped at e^20), A > 0 clipped
        cap = min(ratio_max, math.exp(20.0))
        torch.testing.assert_close(per_token[0], torch.full((T,), -cap).double(), rtol=1e-6, atol=0)
        assert torch.equal(grad[0], torch.zeros_like(grad[0]))
    else:  # r ~ e^-50: A < 0 sits at the lower bound l = max(1 - sqrt(delta / mu), 0.5)
        mu = olp[1].double().exp()
        lower = (1 - (0.05 / mu).sqrt()).clamp(min=0.5)
        torch.testing.assert_close(per_token[1], lower, rtol=1e-6, atol=0)
        assert torch.equal(grad[1], torch.zeros_like(grad[1]))


def test_fully_masked_rows_change_nothing_and_get_no_gradient():
    lp, olp, adv, mask = _batch(4)
    out_full = compute_policy_loss(
        "ripo", logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask
    )
    lp2 = torch.cat([lp.detach(), torch.full((1, lp.shape[1]), float("nan"))]).requires_grad_()
    olp2 = torch.cat([olp, torch.full((1, lp.shape[1]), -float("inf"))])
    adv2 = torch.cat([adv, torch.tensor([5.0], dtype=adv.dtype)])
    mask2 = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])
    out = compute_policy_loss(
        "ripo", logprobs=lp2, old_logprobs=olp2, advantages=adv2, loss_mask=mask2
    )
    (grad,) = torch.autograd.grad(out.loss, lp2)
    torch.testing.assert_close(out.loss, out_full.loss, rtol=1e-12, atol=0)
    assert torch.equal(grad[-1], torch.zeros_like(grad[-1]))
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("delta_low", 0.0),
        ("delta_low", -0.05),
        ("delta_low", float("nan")),
        ("delta_high", float("inf")),
        ("delta_high", None),
        ("ratio_min", 1.0),
        ("ratio_min", -0.1),
        ("ratio_min", float("nan")),
        ("ratio_max", 1.0),
        ("ratio_max", 0.5),
        ("ratio_max", float("nan")),
        ("ratio_max", None),
    ],
)
def test_bad_hyperparameters_are_refused_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        RIPOConfig(**{field: bad})


def test_defaults_are_the_papers():
    assert RIPOConfig() == RIPOConfig(**PAPER)
    assert get_loss_spec("ripo").default_agg_mode == "token-mean"


def test_every_hyperparameter_is_a_trainer_flag():
    config = TrainConfig.from_flags(
        loss="ripo", delta_low=0.02, delta_high=0.08, ratio_min=0.25, ratio_max=5.0
    )
    expected = RIPOConfig(delta_low=0.02, delta_high=0.08, ratio_min=0.25, ratio_max=5.0)
    assert config.objective.loss_config == expected
    argv = "--loss ripo --delta-low 0.05 --delta-high 0.04 --ratio-min 0 --ratio-max inf"
    parsed = parse_args(argv.split()).objective.loss_config
    assert parsed == RIPOConfig(delta_low=0.05, delta_high=0.04, ratio_min=0.0, ratio_max=math.inf)
    assert parse_args(["--loss", "ripo"]).objective.loss_config == RIPOConfig()
    help_text = build_parser().format_help()
    assert "--ratio-min" in help_text and "--ratio-max" in help_text
    with pytest.raises(ValueError, match="--clip-low is not a hyperparameter of --loss ripo"):
        parse_args(["--loss", "ripo", "--clip-low", "0.1"])
    with pytest.raises(ValueError, match="ratio_max"):
        parse_args(["--loss", "ripo", "--ratio-max", "0.9"])
