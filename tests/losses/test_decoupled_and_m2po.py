"""Decoupled PPO and M2PO as rollout corrections, each equal to a float64 reference written from
its formula with AReaL's semantics (behaviour weight exp(prox - behav) masked above its cap, the
capped tokens kept in the denominator; M2PO's largest second moments dropped from the mask until
the mean of the rest is below tau)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.losses import compute_policy_loss, rollout_correction
from megatron_rl.losses.rollout_correction import m2po_dropped
from megatron_rl.train.objective import ObjectiveConfig


def _batch(seed: int, B: int = 5, T: int = 11):
    g = torch.Generator().manual_seed(seed)
    current = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    prox = current + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    behav = prox + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[-1] = False  # a sequence without response tokens
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return current, prox, behav, mask, adv


def _areal_decoupled_loss(current, prox, behav, mask, adv, eps, cap):
    """AReaL's ppo_actor_loss_fn with a proximal policy and behav_imp_weight_cap, in float64:
    pg = max(-A r, -A clip(r)) * w, w = exp(prox - behav) zeroed above the cap, summed over the
    mask and divided by the mask's own count."""
    total, count = 0.0, int(mask.sum())
    for b in range(current.shape[0]):
        for t in range(current.shape[1]):
            if not mask[b, t]:
                continue
            r = math.exp(current[b, t] - prox[b, t])
            a = float(adv[b])
            pg = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
            w = math.exp(prox[b, t] - behav[b, t])
            total += pg * (w if w <= cap else 0.0)
    return total / count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_ppo_equals_areals_proximal_loss(seed):
    current, prox, behav, mask, adv = _batch(seed)
    c = rollout_correction(
        "decoupled", old_logprobs=prox, rollout_logprobs=behav, loss_mask=mask, high=2.0
    )
    assert torch.equal(c.loss_mask, mask)  # capped tokens are zeroed, never dropped
    out = compute_policy_loss(
        "grpo", logprobs=current, old_logprobs=prox, advantages=adv, loss_mask=c.loss_mask,
        loss_agg_mode="token-mean", token_weights=c.weights, clip_low=0.2, clip_high=0.2,
    )  # fmt: skip
    expected = _areal_decoupled_loss(current, prox, behav, mask, adv, eps=0.2, cap=2.0)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    weights = torch.exp(prox - behav)
    capped = mask & (weights > 2.0)
    assert capped.any() and not c.weights[capped].any()
    assert c.metrics["rollout_correction/limited_frac"].item() == pytest.approx(
        capped.sum().item() / mask.sum().item()
    )


def _m2po_reference(delta, mask, tau):
    """The tokens M2PO drops, by the algorithm's words: sort m2 = delta^2 descending and drop
    the fewest largest such that the mean of the rest is below tau (all but one if never)."""
    values = sorted(
        ((float(delta[b, t]) ** 2, b * delta.shape[1] + t) for b, t in mask.nonzero().tolist()),
        key=lambda x: (-x[0], x[1]),
    )
    n = len(values)
    k = next((i for i in range(n) if sum(v for v, _ in values[i:]) / (n - i) < tau), n - 1)
    dropped = torch.zeros_like(mask)
    for _, flat in values[:k]:
        dropped[flat // delta.shape[1], flat % delta.shape[1]] = True
    return dropped


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("tau", [0.04, 0.3, 5.0])
def test_m2po_drops_exactly_the_reference_tokens_and_weights_the_rest(seed, tau):
    current, prox, behav, mask, adv = _batch(seed)
    expected = _m2po_reference(prox - behav, mask, tau)
    assert torch.equal(m2po_dropped(prox - behav, mask, tau), expected)
    c = rollout_correction(
        "m2po", old_logprobs=prox, rollout_logprobs=behav, loss_mask=mask, tau=tau, high=5.0
    )
    kept = mask & ~expected
    assert torch.equal(c.loss_mask, kept)  # dropped tokens leave the denominator (AReaL)
    kept_m2 = (prox - behav)[kept].square()
    assert kept_m2.mean().item() < tau or kept.sum() == 1
    out = compute_policy_loss(
        "grpo", logprobs=current, old_logprobs=prox, advantages=adv, loss_mask=c.loss_mask,
        loss_agg_mode="token-mean", token_weights=c.weights,
    )  # fmt: skip
    reference = _areal_decoupled_loss(current, prox, behav, kept, adv, eps=0.2, cap=5.0)
    assert out.loss.item() == pytest.approx(reference, rel=1e-12, abs=1e-14)
    assert c.metrics["rollout_correction/m2po_masked_frac"].item() == pytest.approx(
        expected.sum().item() / mask.sum().item()
    )


def test_m2po_edges_nothing_to_drop_and_nothing_below_tau():
    delta = torch.tensor([[0.01, -0.02, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert not m2po_dropped(delta, mask, 0.04).any()  # already below tau
    big = torch.tensor([[3.0, -2.0, 1.0]], dtype=torch.float64)
    assert m2po_dropped(big, mask, 0.04).tolist() == [[True, True, False]]  # all but the least
    assert not m2po_dropped(big, torch.zeros_like(mask), 0.04).any()


def test_decoupled_modes_need_the_trainers_recompute_as_the_clip_target():
    with pytest.raises(
        ValueError, match=r"--rollout-correction='m2po'.*--behavior-logprobs trainer"
    ):
        ObjectiveConfig(rollout_correction="m2po", behavior_logprobs="rollout")
    ObjectiveConfig(rollout_correction="decoupled", behavior_logprobs="trainer")
    with pytest.raises(ValueError, match="tau"):
        rollout_correction(
            "m2po", old_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.zeros(1, 2),
            loss_mask=torch.ones(1, 2, dtype=torch.bool), tau=0.0,
        )  # fmt: skip
