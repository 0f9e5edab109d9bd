"""`objective`: policy loss + kl_coef * KL, one aggregation resolved once for both terms."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.losses import compute_policy_loss, get_loss_spec, kl_penalty
from megatron_rl.losses.aggregation import aggregate_padded
from megatron_rl.train.objective import ObjectiveConfig, objective


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.1 - 1).requires_grad_()
    old = lp.detach() + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.05
    ref = lp.detach() + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.05
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    return lp, old, ref, mask, torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)


@pytest.mark.parametrize("loss", ["grpo", "vespo", "epic"])
def test_objective_is_the_policy_loss_plus_the_kl_term_under_one_aggregation(loss):
    lp, old, ref, mask, adv = _batch()
    config = ObjectiveConfig(loss=loss, kl_coef=0.25, max_response_length=5)
    assert config.agg_mode == get_loss_spec(loss).default_agg_mode
    out = objective(
        config,
        logprobs_BT=lp,
        old_logprobs_BT=old,
        advantages_B=adv,
        loss_mask_BT=mask,
        num_tokens=20.0,
        num_seqs=6.0,
        ref_logprobs_BT=ref,
    )
    policy = compute_policy_loss(
        loss,
        logprobs=lp,
        old_logprobs=old,
        advantages=adv,
        loss_mask=mask,
        loss_agg_mode=config.agg_mode,
        global_num_tokens=20.0,
        global_num_seqs=6.0,
        max_response_length=5,
    ).loss
    kl = aggregate_padded(
        kl_penalty(lp, ref, mask, "k3"),
        mask,
        config.agg_mode,
        global_num_tokens=20.0,
        global_num_seqs=6.0,
        max_response_length=5,
    )
    torch.testing.assert_close(out.loss, policy + 0.25 * kl, rtol=1e-14, atol=0)
    torch.testing.assert_close(out.metrics["kl/value"], kl.detach(), rtol=1e-14, atol=0)


def test_an_explicit_aggregation_applies_to_both_terms():
    config = ObjectiveConfig(loss="grpo", loss_agg_mode="seq-mean-token-sum", kl_coef=0.1)
    assert config.agg_mode == "seq-mean-token-sum"


def test_reference_log_probs_are_required_exactly_with_a_kl_term():
    lp, old, ref, mask, adv = _batch()
    common = dict(
        logprobs_BT=lp, old_logprobs_BT=old, advantages_B=adv, loss_mask_BT=mask, num_tokens=20.0
    )
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        objective(ObjectiveConfig(kl_coef=0.1), num_seqs=6.0, **common)
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        objective(ObjectiveConfig(kl_coef=0.0), num_seqs=6.0, ref_logprobs_BT=ref, **common)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss": "nope"}, "nope"),
        ({"kl_estimator": "k9"}, "kl_estimator"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"kl_coef": float("nan")}, "kl_coef"),
        ({"loss": "epic", "loss_params": (("variant", "wide"),)}, "variant"),
    ],
)
def test_bad_objective_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveConfig(**kwargs)
