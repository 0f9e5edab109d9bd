"""Group advantages from per-sample rewards (one group = the n samples of one prompt).

* ``grpo``: ``A_i = (r_i - mean_g r) / (std_g r + eps)`` (Shao et al. 2024, DeepSeekMath), with
  the population standard deviation of the group;
* ``drgrpo``: ``A_i = r_i - mean_g r`` (Liu et al. 2025, "Understanding R1-Zero-Like Training",
  Dr. GRPO: no std normalisation).

A group whose rewards are all equal carries no signal (every advantage is 0); ``zero_variance_B``
marks its samples so the trainer can leave them out of the loss denominators.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo")


def group_advantages(
    rewards_B: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages_B, zero_variance_B)`` for rewards laid out group after group.

    Args:
        rewards_B: float ``[num_groups * group_size]``, prompt-major (the engines' order).
        group_size: samples per prompt (``n``).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"estimator={estimator!r} is unknown; choose one of {ADVANTAGE_ESTIMATORS}"
        )
    if group_size < 1 or rewards_B.numel() % group_size:
        raise ValueError(
            f"{rewards_B.numel()} rewards do not split into groups of {group_size} samples"
        )
    if not bool(torch.isfinite(rewards_B).all()):
        raise ValueError("rewards hold NaN or inf; reward functions must return finite numbers")
    rewards_GN = rewards_B.double().reshape(-1, group_size)
    centered_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    zero_variance_GN = (
        (rewards_GN == rewards_GN[:, :1]).all(dim=1, keepdim=True).expand_as(rewards_GN)
    )
    if estimator == "grpo":
        std_G1 = rewards_GN.std(dim=1, unbiased=False, keepdim=True)
        centered_GN = centered_GN / (std_G1 + eps)
    advantages = torch.where(zero_variance_GN, 0.0, centered_GN)
    return advantages.reshape(-1).to(torch.float32), zero_variance_GN.reshape(-1)
