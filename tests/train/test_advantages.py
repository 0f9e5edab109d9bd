"""Group advantages: GRPO (population std + eps) and Dr. GRPO (mean-centred) on hand-made groups.

Every expected number below is written out by hand from the reward groups, not recomputed with
the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.train.advantages import ADVANTAGE_ESTIMATORS, group_advantages


def _rewards(*values: float, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def test_estimators_are_grpo_and_drgrpo():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo"}


def test_grpo_uses_population_std_of_the_group():
    # mean 3, deviations (-2, -1, 0, 3), population variance (4 + 1 + 0 + 9) / 4 = 3.5.
    # (The unbiased std sqrt(14 / 3) would give -0.9258 for the first sample.)
    std = math.sqrt(3.5)
    advantages, zero_variance = group_advantages(_rewards(1, 2, 3, 6), 4, "grpo", eps=0.0)
    expected = torch.tensor([-2 / std, -1 / std, 0.0, 3 / std])
    assert torch.allclose(advantages, expected, atol=1e-6, rtol=0)
    assert torch.allclose(advantages[0], torch.tensor(-1.0690450), atol=1e-6, rtol=0)
    assert not zero_variance.any()


def test_grpo_default_eps_is_added_to_the_std():
    # Binary rewards: mean 0.5, std 0.5, so A = +-0.5 / (0.5 + 1e-6) = +-0.999998000004.
    advantages, _ = group_advantages(_rewards(0, 1, 1, 0), 4)
    value = 0.5 / 0.500001
    assert torch.allclose(advantages, torch.tensor([-value, value, value, -value]), atol=1e-7)
    # A tiny spread makes eps visible: rewards (0, 1e-6) have mean 5e-7 and std 5e-7, so
    # A = +-5e-7 / (5e-7 + 1e-6) = +-1/3. (sqrt(var + eps) would give ~5e-4; the unbiased
    # std would give ~0.293.)
    advantages, zero_variance = group_advantages(_rewards(0.0, 1e-6, dtype=torch.float64), 2)
    assert torch.allclose(advantages, torch.tensor([-1 / 3, 1 / 3]), atol=1e-6, rtol=0)
    assert not zero_variance.any()


def test_grpo_eps_argument_is_used():
    # mean 0.5, std 0.5, eps 0.5: A = +-0.5 / 1.0
    advantages, _ = group_advantages(_rewards(0, 1), 2, "grpo", eps=0.5)
    assert torch.allclose(advantages, torch.tensor([-0.5, 0.5]), atol=1e-7, rtol=0)


def test_drgrpo_only_centres_the_rewards():
    advantages, zero_variance = group_advantages(_rewards(1, 2, 3, 6), 4, "drgrpo")
    assert torch.allclose(advantages, torch.tensor([-2.0, -1.0, 0.0, 3.0]), atol=1e-6, rtol=0)
    assert not zero_variance.any()
    advantages, _ = group_advantages(_rewards(0.0, 0.25, 1.0), 3, "drgrpo")
    mean = 1.25 / 3
    assert torch.allclose(
        advantages, torch.tensor([-mean, 0.25 - mean, 1.0 - mean]), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo"])
def test_groups_are_normalised_separately(estimator):
    # Group 1 (0, 1): mean 0.5, std 0.5. Group 2 (10, 12): mean 11, std 1.
    # One pooled group would have mean 5.75 and every advantage of group 1 negative.
    advantages, zero_variance = group_advantages(_rewards(0, 1, 10, 12), 2, estimator, eps=0.0)
    if estimator == "grpo":
        expected = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    else:
        expected = torch.tensor([-0.5, 0.5, -1.0, 1.0])
    assert torch.allclose(advantages, expected, atol=1e-6, rtol=0)
    assert zero_variance.tolist() == [False] * 4


def test_groups_are_laid_out_prompt_major():
    # 3 groups of 3: rewards of group g are contiguous, groups follow each other.
    rewards = _rewards(1, 0, 0, 5, 5, 5, 0, 2, 4)
    advantages, zero_variance = group_advantages(rewards, 3, "drgrpo")
    expected = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, -2.0, 0.0, 2.0]
    assert torch.allclose(advantages, torch.tensor(expected), atol=1e-6, rtol=0)
    assert zero_variance.tolist() == [False] * 3 + [True] * 3 + [False] * 3


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo"])
def test_zero_variance_groups_are_flagged_and_get_zero_advantage(estimator):
    rewards = _rewards(0.3, 0.3, 0.3, 0.0, 1.0, 1.0, -2.0, -2.0, -2.0)
    advantages, zero_variance = group_advantages(rewards, 3, estimator)
    assert zero_variance.dtype == torch.bool
    assert zero_variance.tolist() == [True] * 3 + [False] * 3 + [True] * 3
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert torch.equal(advantages[6:], torch.zeros(3))
    # The middle group (0, 1, 1): mean 2/3, population std sqrt(2) / 3.
    centred = torch.tensor([-2 / 3, 1 / 3, 1 / 3])
    if estimator == "grpo":
        centred = centred / (math.sqrt(2) / 3 + 1e-6)
    assert torch.allclose(advantages[3:6], centred, atol=1e-6, rtol=0)
    assert torch.isfinite(advantages).all()


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo"])
def test_equal_float64_rewards_give_exact_zeros_despite_rounding(estimator):
    # In float64, mean(0.7, 0.7, 0.7) != 0.7 (off by ~1e-16): the centred rewards are not exactly
    # 0, and GRPO would turn them into ~1e-10 after dividing by eps. They must still be exactly 0.
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    advantages, zero_variance = group_advantages(rewards, 3, estimator)
    assert zero_variance.all()
    assert torch.equal(advantages, torch.zeros(6))


def test_group_size_one_has_no_signal():
    advantages, zero_variance = group_advantages(_rewards(0.0, 1.0, 7.0), 1)
    assert torch.equal(advantages, torch.zeros(3))
    assert zero_variance.all()


def test_all_groups_zero_variance_gives_all_zero_advantages():
    advantages, zero_variance = group_advantages(torch.ones(8), 4)
    assert torch.equal(advantages, torch.zeros(8)) and zero_variance.all()


def test_shapes_follow_the_rewards():
    advantages, zero_variance = group_advantages(torch.arange(12, dtype=torch.float32), 4)
    assert advantages.shape == zero_variance.shape == (12,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_advantages_are_float32_for_any_reward_dtype(dtype):
    rewards = torch.tensor([0, 1, 3, 3], dtype=dtype)
    advantages, zero_variance = group_advantages(rewards, 2, "drgrpo")
    assert advantages.dtype == torch.float32
    assert zero_variance.dtype == torch.bool
    assert torch.allclose(advantages, torch.tensor([-0.5, 0.5, 0.0, 0.0]))
    assert zero_variance.tolist() == [False, False, True, True]


def test_rewards_are_not_modified():
    rewards = _rewards(1, 2, 3, 6)
    before = rewards.clone()
    group_advantages(rewards, 2)
    group_advantages(rewards, 2, "drgrpo")
    assert torch.equal(rewards, before)


@pytest.mark.parametrize(
    ("numel", "group_size"), [(5, 2), (3, 4), (4, 0), (4, -2), (7, 3)], ids=str
)
def test_rewards_that_do_not_split_into_groups_are_rejected(numel, group_size):
    with pytest.raises(ValueError, match="do not split into groups"):
        group_advantages(torch.zeros(numel), group_size)


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="estimator='ppo' is unknown"):
        group_advantages(_rewards(0, 1), 2, "ppo")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_are_rejected(bad):
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages(_rewards(0.0, bad, 1.0, 1.0), 2)
