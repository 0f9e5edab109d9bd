"""The registry is an explicit allowlist; bad names and hyperparameters fail with clear errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from loss_batches import make_batch
from paper_losses import DEFAULT_AGG, PAPER_LOSSES

from megatron_rl.losses import (
    LossTerms,
    available_losses,
    compute_policy_loss,
    get_loss_spec,
    register_policy_loss,
    registry,
)

EXPECTED = set(PAPER_LOSSES)


def test_all_paper_losses_are_registered_with_their_default_aggregation():
    assert set(available_losses()) >= EXPECTED
    for name, mode in DEFAULT_AGG.items():
        assert get_loss_spec(name).default_agg_mode == mode


def test_unknown_loss_names_the_available_ones(batch):
    with pytest.raises(ValueError, match=r"unknown policy loss 'vespa'.*vespo"):
        compute_policy_loss("vespa", **batch.kwargs())


def test_unknown_hyperparameter_lists_the_known_ones(batch):
    with pytest.raises(ValueError, match=r"no hyperparameter\(s\) \['clip_low'\].*c1_pos"):
        compute_policy_loss("vespo", clip_low=0.2, **batch.kwargs())


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("grpo", {"clip_low": 1.5}),
        ("grpo", {"clip_ratio_c": 0.5}),
        ("vespo", {"c1_pos": 0.0}),
        ("epic", {"delta_low": -1.0}),
        ("epic", {"variant": "clipped"}),
        ("sapo", {"tau_neg": 0.0}),
        ("cispo", {"clip_high": float("nan")}),
    ],
)
def test_invalid_hyperparameter_value_names_the_field(batch, name, bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        compute_policy_loss(name, **bad, **batch.kwargs())


def test_unknown_aggregation_mode_lists_the_modes(batch):
    with pytest.raises(ValueError, match=r"loss_agg_mode='mean'.*token-mean"):
        compute_policy_loss("grpo", loss_agg_mode="mean", **batch.kwargs())


def test_user_registered_loss_is_callable_through_the_api(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # undone after the test

    @dataclass(frozen=True, kw_only=True, slots=True)
    class ScaledConfig:
        scale: float = 2.0

    @register_policy_loss(
        "test_scaled_reinforce", config=ScaledConfig, default_agg_mode="token-mean"
    )
    def scaled(inputs, config):
        return LossTerms(-config.scale * inputs.advantages_BT * inputs.logprobs_BT)

    b = make_batch()
    out = compute_policy_loss("test_scaled_reinforce", scale=3.0, **b.kwargs())
    mask = b.loss_mask
    adv_BT = b.advantages[:, None].expand_as(mask)
    expected = (-3.0 * adv_BT * b.logprobs.detach())[mask].mean()
    torch.testing.assert_close(out.loss.detach(), expected)
    assert "test_scaled_reinforce" in available_losses()
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss(
            "test_scaled_reinforce", config=ScaledConfig, default_agg_mode="token-mean"
        )(scaled)
