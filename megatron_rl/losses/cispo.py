"""CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention", arXiv 2506.13585, Sec. 3.1).

REINFORCE with a clipped, stop-gradient token importance weight:

    l_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A * log pi_theta(y_t),

aggregated with ``token-mean`` (the paper's ``1 / sum_i |o_i|``). The paper imposes no lower
bound ("setting eps_low to a large value") and tunes only the upper one without publishing its
value; we default to ``clip_low = None`` (no lower bound) and ``clip_high = 0.28``, the value
common reproductions use. The weight is computed as ``exp(clamp(log r))``, which never overflows.
CISPO keeps every token's gradient; ``clipped_BT`` marks the tokens whose weight the clip acted on
(those counted by ``clip_frac_high`` / ``clip_frac_low``, whatever the advantage's sign).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import masked_mean
from megatron_rl.losses.registry import LossTerms, register_policy_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class CISPOConfig:
    clip_low: float | None = None
    clip_high: float = 0.28

    def __post_init__(self) -> None:
        if self.clip_low is not None and not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1) or None, got {self.clip_low}")
        if not (math.isfinite(self.clip_high) and self.clip_high >= 0.0):
            raise ValueError(f"clip_high must be finite and >= 0, got {self.clip_high}")


@register_policy_loss("cispo", config=CISPOConfig, default_agg_mode="token-mean")
def cispo_loss(inputs: PaddedInputs, config: CISPOConfig) -> LossTerms:
    lp_BT, mask_BT = inputs.logprobs_BT, inputs.mask_BT
    with torch.no_grad():
        log_r_BT = lp_BT - inputs.old_logprobs_BT
        log_high = math.log1p(config.clip_high)
        log_low = -math.inf if config.clip_low is None else math.log1p(-config.clip_low)
        weight_BT = torch.exp(log_r_BT.clamp(min=log_low, max=log_high))
        high, low = log_r_BT > log_high, log_r_BT < log_low
        metrics = {
            "clip_frac_high": masked_mean(high.to(lp_BT.dtype), mask_BT),
            "clip_frac_low": masked_mean(low.to(lp_BT.dtype), mask_BT),
            "weight_mean": masked_mean(weight_BT, mask_BT),
        }
    loss_BT = -weight_BT * inputs.advantages_BT * lp_BT
    return LossTerms(loss_BT, metrics, (high | low) & mask_BT)
