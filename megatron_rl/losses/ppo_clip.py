"""GRPO and DAPO: the token-level PPO clipped surrogate.

For ``r_t = exp(log pi_theta - log mu)`` and advantage ``A``,
``l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))`` (PPO, Schulman et al. 2017;
GRPO, Shao et al. 2024, "DeepSeekMath"), optionally with the dual clip of Ye et al. 2020
("Mastering Complex Control in MOBA Games with Deep RL") for ``A < 0``:
``l_t = min(l_t, -A * clip_ratio_c)``. DAPO (Yu et al. 2025) is the same surrogate with the
decoupled "clip-higher" bound ``clip_high = 0.28`` and token-mean aggregation.
``r_t`` comes from ``capped_exp`` (exact for ``log r_t <= 20``). ``clipped_BT`` marks the tokens
counted by ``clip_frac_high``, ``clip_frac_low`` and ``dual_clip_frac`` (disjoint sets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import capped_exp, masked_mean
from megatron_rl.losses.registry import LossTerms, register_policy_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOClipConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"clip_ratio_c (dual clip) must be > 1 or None, got {self.clip_ratio_c}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class DAPOConfig(PPOClipConfig):
    clip_high: float = 0.28


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
) -> torch.Tensor:
    """Elementwise PPO loss ``max(-A r, -A clip(r, 1-cl, 1+ch))`` (+ dual clip for ``A < 0``)."""
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # ties (ratio inside the clip range) take the unclipped branch and its full gradient
    loss = torch.where(unclipped_loss >= clipped_loss, unclipped_loss, clipped_loss)
    if clip_ratio_c is not None:
        dual_clipped = (advantages < 0) & (loss > -advantages * clip_ratio_c)
        loss = torch.where(dual_clipped, -advantages * clip_ratio_c, loss)
    return loss


@torch.no_grad()
def clip_sides(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool maps of the positions whose gradient the upper / lower clip removes."""
    high = (advantages > 0) & (ratio > 1 + clip_high)
    low = (advantages < 0) & (ratio < 1 - clip_low)
    return high, low


@torch.no_grad()
def clip_fractions(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> dict[str, torch.Tensor]:
    """Fractions of masked positions whose gradient the clip removes, per side (ratio's dtype)."""
    high, low = clip_sides(ratio, advantages, clip_low, clip_high)
    return {
        "clip_frac_high": masked_mean(high.to(ratio.dtype), mask),
        "clip_frac_low": masked_mean(low.to(ratio.dtype), mask),
    }


def ppo_clip_loss(inputs: PaddedInputs, config: PPOClipConfig) -> LossTerms:
    log_ratio_BT = inputs.logprobs_BT - inputs.old_logprobs_BT
    ratio_BT = capped_exp(log_ratio_BT)
    adv_BT, mask_BT = inputs.advantages_BT, inputs.mask_BT
    loss_BT = clipped_surrogate(
        ratio_BT, adv_BT, config.clip_low, config.clip_high, config.clip_ratio_c
    )
    with torch.no_grad():
        ratio = ratio_BT.detach()
        high, low = clip_sides(ratio, adv_BT, config.clip_low, config.clip_high)
        metrics = {
            "clip_frac_high": masked_mean(high.to(ratio.dtype), mask_BT),
            "clip_frac_low": masked_mean(low.to(ratio.dtype), mask_BT),
        }
        clipped_BT = high | low
        if config.clip_ratio_c is not None:  # disjoint from low: the ratio is above c > 1
            dual = (adv_BT < 0) & (ratio > config.clip_ratio_c)
            metrics["dual_clip_frac"] = masked_mean(dual.to(ratio.dtype), mask_BT)
            clipped_BT = clipped_BT | dual
    return LossTerms(loss_BT, metrics, clipped_BT & mask_BT)


register_policy_loss("grpo", config=PPOClipConfig, default_agg_mode="seq-mean-token-mean")(
    ppo_clip_loss
)
register_policy_loss("dapo", config=DAPOConfig, default_agg_mode="token-mean")(ppo_clip_loss)
