"""GSPO and GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071).

GSPO clips the length-normalised sequence ratio
``s_i = exp((1/|y_i|) sum_t (log pi_theta - log mu))`` with the PPO surrogate
``max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))``; every token of sequence ``i``
carries that value, so ``seq-mean-token-mean`` gives the paper's ``(1/G) sum_i``.
GSPO-token uses ``s_it = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]``: the same value and, for
sequence advantages, the same gradient ``(1/|y_i|) sum_t s_i A_i grad log pi_t``, while allowing a
different advantage per token. Defaults: ``clip_low = 3e-4``, ``clip_high = 4e-4`` (the paper's).
``clipped_BT`` marks the tokens counted by ``clip_frac_high`` / ``clip_frac_low`` (for gspo, every
token of a clipped sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import capped_exp, masked_mean
from megatron_rl.losses.ppo_clip import clipped_surrogate
from megatron_rl.losses.registry import LossTerms, register_policy_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class GSPOConfig:
    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")


def sequence_log_ratio_mean(inputs: PaddedInputs) -> torch.Tensor:
    """``[B]`` length-normalised sequence log-ratio ``(1/|y_i|) sum_t (log pi - log mu)``."""
    log_ratio_BT = inputs.logprobs_BT - inputs.old_logprobs_BT
    num_tokens_B = inputs.mask_BT.sum(dim=-1).clamp(min=1)
    return log_ratio_BT.sum(dim=-1) / num_tokens_B


def _gspo(inputs: PaddedInputs, config: GSPOConfig, token_level: bool) -> LossTerms:
    log_s_B = sequence_log_ratio_mean(inputs)
    if token_level:
        lp_BT = inputs.logprobs_BT
        log_s_BT = log_s_B.detach()[:, None] + (lp_BT - lp_BT.detach())
    else:
        log_s_BT = log_s_B[:, None].expand_as(inputs.logprobs_BT)
    s_BT = capped_exp(log_s_BT)
    adv_BT = inputs.advantages_BT
    loss_BT = clipped_surrogate(s_BT, adv_BT, config.clip_low, config.clip_high)
    with torch.no_grad():
        s = s_BT.detach()
        mask = inputs.mask_BT
        high = (adv_BT > 0) & (s > 1 + config.clip_high)
        low = (adv_BT < 0) & (s < 1 - config.clip_low)
        metrics = {
            "clip_frac_high": masked_mean(high.to(s.dtype), mask),
            "clip_frac_low": masked_mean(low.to(s.dtype), mask),
            "seq_ratio_mean": masked_mean(s, mask),
        }
    return LossTerms(loss_BT, metrics, (high | low) & mask)


@register_policy_loss(
    "gspo", config=GSPOConfig, default_agg_mode="seq-mean-token-mean", sequence_advantages=True
)
def gspo_loss(inputs: PaddedInputs, config: GSPOConfig) -> LossTerms:
    return _gspo(inputs, config, token_level=False)


@register_policy_loss("gspo_token", config=GSPOConfig, default_agg_mode="seq-mean-token-mean")
def gspo_token_loss(inputs: PaddedInputs, config: GSPOConfig) -> LossTerms:
    return _gspo(inputs, config, token_level=True)
