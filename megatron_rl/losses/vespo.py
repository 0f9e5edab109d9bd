"""VESPO (Shen et al. 2026, "VESPO: Variational Sequence-Level Soft Policy Optimization for Stable
Off-Policy LLM Training", arXiv 2602.10693).

Sequence weight ``W_i = pi_theta(y_i) / mu(y_i) = exp(sum_t (log pi_theta - log mu))``, with no
length normalisation. Reshaping kernel (the paper's shifted form, Sec. 3.3):

    phi(W) = W^c1 * exp(c2 * (1 - W)),      phi(1) = 1,

evaluated as ``exp(c1 log W + c2 (1 - W))`` and detached (Sec. 3.5). The loss is REINFORCE-style,

    l_it = -sg[phi(W_i)] * A_i * log pi_theta(y_it),

with ``(c1, c2) = (c1_pos, c2_pos) = (2, 3)`` for ``A_i >= 0`` and ``(c1_neg, c2_neg) = (3, 2)`` for
``A_i < 0`` (App. D), aggregated with ``token-mean``.

Numerics: ``phi`` peaks at ``W = c1/c2`` (``phi_max = (c1/c2)^c1 exp(c2 - c1)``, App. C) and
decreases beyond, so ``log W`` is clamped at ``LOG_W_MAX = 50``: for ``W > e^50``,
``c2 (1 - W) < -5e21 * c2`` and ``phi`` underflows to exactly 0 in float32 and float64 both with
and without the clamp. No other approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import masked_extreme, masked_mean, where_scalars
from megatron_rl.losses.registry import LossTerms, register_policy_loss

LOG_W_MAX = 50.0


@dataclass(frozen=True, kw_only=True, slots=True)
class VESPOConfig:
    c1_pos: float = 2.0
    c2_pos: float = 3.0
    c1_neg: float = 3.0
    c2_neg: float = 2.0

    def __post_init__(self) -> None:
        for field_name in ("c1_pos", "c2_pos", "c1_neg", "c2_neg"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{field_name} must be a finite number > 0 (the kernel is bounded only for "
                    f"c1, c2 > 0), got {value}"
                )
        for c1, c2, side in ((self.c1_pos, self.c2_pos, "pos"), (self.c1_neg, self.c2_neg, "neg")):
            if math.log(c1 / c2) > LOG_W_MAX - 10:
                raise ValueError(
                    f"c1_{side}/c2_{side} = {c1 / c2:g} puts the kernel's peak beyond "
                    f"W = e^{LOG_W_MAX - 10:g}; choose c2_{side} closer to c1_{side}"
                )


def vespo_log_kernel(log_w: torch.Tensor, c1: torch.Tensor | float, c2: torch.Tensor | float):
    """``log phi(W) = c1 log W + c2 (1 - W)`` from ``log W``, finite for every finite ``log W``."""
    log_w = log_w.clamp(max=LOG_W_MAX)
    return c1 * log_w + c2 * (-torch.expm1(log_w))


def vespo_kernel(log_w: torch.Tensor, c1: torch.Tensor | float, c2: torch.Tensor | float):
    """``phi(W) = W^c1 exp(c2 (1 - W))`` from ``log W`` (in [0, phi_max])."""
    return torch.exp(vespo_log_kernel(log_w, c1, c2))


@register_policy_loss(
    "vespo", config=VESPOConfig, default_agg_mode="token-mean", sequence_advantages=True
)
def vespo_loss(inputs: PaddedInputs, config: VESPOConfig) -> LossTerms:
    mask_BT = inputs.mask_BT
    seq_mask_B = mask_BT.any(dim=-1)
    with torch.no_grad():
        log_w_B = (inputs.logprobs_BT - inputs.old_logprobs_BT).sum(dim=-1)
        adv_B = inputs.sequence_advantages_B()
        positive_B = adv_B >= 0
        c1_B = where_scalars(positive_B, config.c1_pos, config.c1_neg, like=log_w_B)
        c2_B = where_scalars(positive_B, config.c2_pos, config.c2_neg, like=log_w_B)
        phi_B = vespo_kernel(log_w_B, c1_B, c2_B)
    loss_BT = -(phi_B * adv_B)[:, None] * inputs.logprobs_BT
    metrics = {
        "phi_mean": masked_mean(phi_B, seq_mask_B),
        "phi_min": masked_extreme(phi_B, seq_mask_B, largest=False),
        "phi_max": masked_extreme(phi_B, seq_mask_B, largest=True),
        "phi_mean_pos_adv": masked_mean(phi_B, seq_mask_B & positive_B),
        "phi_mean_neg_adv": masked_mean(phi_B, seq_mask_B & ~positive_B),
        "phi_below_0.1_frac": masked_mean((phi_B < 0.1).to(phi_B.dtype), seq_mask_B),
    }
    return LossTerms(loss_BT, metrics)
