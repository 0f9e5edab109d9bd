"""OPSM: equal to a float64 reference written from the DeepSeek-V3.2 / slime formula (per
sequence mean of behaviour minus current log-prob over the loss mask, a strict threshold, the
advantage tested per token), through the objective at every update with the masked tokens kept
in the denominator."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.losses.opsm import opsm_keep
from megatron_rl.train.objective import ObjectiveConfig, objective


def _reference_keep(current, behaviour, adv_BT, mask, delta):
    keep = torch.ones_like(current)
    for b in range(current.shape[0]):
        tokens = [t for t in range(current.shape[1]) if mask[b, t]]
        drift = sum(float(behaviour[b, t] - current[b, t]) for t in tokens) / max(len(tokens), 1)
        for t in tokens:
            if float(adv_BT[b, t]) < 0 and drift > delta:
                keep[b, t] = 0.0
    return keep


def _batch(seed, B=6, T=10):
    g = torch.Generator().manual_seed(seed)
    current = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    behaviour = current + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.85
    mask[0] = False
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return current, behaviour, mask, adv


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("delta", [0.0, 1e-4, 0.02])
def test_opsm_equals_the_formula_for_sequence_and_token_advantages(seed, delta):
    current, behaviour, mask, adv = _batch(seed)
    keep, metrics = opsm_keep(current, behaviour, adv, mask, delta)
    adv_BT = adv[:, None].expand_as(current)
    assert torch.equal(keep, _reference_keep(current, behaviour, adv_BT, mask, delta))
    token_adv = torch.randn(current.shape, generator=torch.Generator().manual_seed(seed))
    keep_t, _ = opsm_keep(current, behaviour, token_adv.double(), mask, delta)
    assert torch.equal(keep_t, _reference_keep(current, behaviour, token_adv, mask, delta))
    masked = (keep == 0) & mask
    assert metrics["opsm/masked_token_frac"].item() == pytest.approx(
        masked.sum().item() / mask.sum().item()
    )


def test_the_threshold_is_strict_and_positive_advantages_are_never_masked():
    current = torch.zeros(3, 4, dtype=torch.float64)
    behaviour = torch.full_like(current, 0.5)  # every sequence drifted by exactly 0.5
    mask = torch.ones(3, 4, dtype=torch.bool)
    adv = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    keep, metrics = opsm_keep(current, behaviour, adv, mask, 0.5)
    assert keep.all()  # D == delta: kept
    keep, metrics = opsm_keep(current, behaviour, adv, mask, 0.4999)
    assert keep.tolist() == [[0.0] * 4, [1.0] * 4, [1.0] * 4]
    assert metrics["opsm/masked_seq_frac"].item() == pytest.approx(1 / 3)
    assert metrics["opsm/seq_kl_mean"].item() == pytest.approx(0.5)


def test_the_objective_zeroes_masked_tokens_and_keeps_them_in_the_denominator():
    current, behaviour, mask, adv = _batch(7)
    current.requires_grad_(True)
    num_tokens, num_seqs = float(mask.sum()), float(mask.any(-1).sum())
    common = dict(
        old_logprobs_BT=behaviour, advantages_B=adv, loss_mask_BT=mask,
        num_tokens=num_tokens, num_seqs=num_seqs,
    )  # fmt: skip
    with_opsm = objective(ObjectiveConfig(opsm_delta=0.0), logprobs_BT=current, **common)
    keep = _reference_keep(current.detach(), behaviour, adv[:, None].expand(6, 10), mask, 0.0)
    assert (keep[mask] == 0).any() and (keep[mask] == 1).any()
    by_hand = objective(ObjectiveConfig(), logprobs_BT=current, token_weights_BT=keep, **common)
    assert with_opsm.loss.item() == pytest.approx(by_hand.loss.item(), rel=1e-12)
    with_opsm.loss.backward()
    grad = current.grad
    assert not grad[(keep == 0) & mask].any() and grad[(keep == 1) & mask].any()
    assert "opsm/masked_seq_frac" in with_opsm.metrics


def test_a_negative_or_non_finite_delta_names_the_flag():
    with pytest.raises(ValueError, match="opsm"):
        ObjectiveConfig(opsm_delta=-1.0)
    with pytest.raises(ValueError, match="opsm"):
        ObjectiveConfig(opsm_delta=float("nan"))
