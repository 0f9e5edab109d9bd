"""Reward functions (response text, reference answer) -> float, and batch scoring."""

from megatron_rl.rewards.addition_trace_reward import score_addition_trace
from megatron_rl.rewards.batch import RewardBatch, RewardFn, compute_rewards
from megatron_rl.rewards.builtin_reward import score_builtin_response
from megatron_rl.rewards.math_reward import math_reward
from megatron_rl.rewards.registry import available_rewards, get_reward_fn

__all__ = [
    "RewardBatch",
    "RewardFn",
    "available_rewards",
    "compute_rewards",
    "get_reward_fn",
    "math_reward",
    "score_addition_trace",
    "score_builtin_response",
]
