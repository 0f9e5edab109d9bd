"""SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347).

Token-level soft gate instead of a hard clip: with ``r_t = exp(log pi_theta - log mu)`` and
``tau = tau_pos`` if ``A >= 0`` else ``tau_neg``,

    f(r) = sigma(tau (r - 1)) * 4 / tau,      l_t = -A f(r_t),

whose gradient is ``-A * 4 sigma(z) (1 - sigma(z)) * r_t * grad log pi_t`` (``z = tau (r - 1)``),
equal to the on-policy gradient at ``r = 1``. The loss is written as
``-A (sg[f(r)] + sg[w] (log pi - sg[log pi]))`` with ``w = 4 sigma(z) sigma(-z) r`` evaluated in
log space, which is the same value and gradient without the ``inf * 0`` that autograd would meet
for huge ratios. ``log r`` is clamped at 50 where both ``f`` and ``w`` have saturated (``f`` to
``4 / tau``, ``w`` to exactly 0) in float32 and float64. Defaults ``tau_pos = 1.0``,
``tau_neg = 1.05`` (the paper's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import masked_mean, where_scalars
from megatron_rl.losses.registry import LossTerms, register_policy_loss

_LOG_R_MAX = 50.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SAPOConfig:
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        for field_name in ("tau_pos", "tau_neg"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{field_name} (gate temperature) must be > 0, got {value}")


def sapo_gate_and_weight(log_ratio: torch.Tensor, tau: torch.Tensor):
    """``f(r) = 4 sigma(tau (r-1)) / tau`` and ``w = r f'(r) = 4 sigma(z) sigma(-z) r``."""
    log_r = log_ratio.clamp(max=_LOG_R_MAX)
    z = tau * torch.expm1(log_r)
    gate = torch.sigmoid(z) * (4.0 / tau)
    log_w = math.log(4.0) - F.softplus(-z) - F.softplus(z) + log_r
    return gate, torch.exp(log_w)


@register_policy_loss("sapo", config=SAPOConfig, default_agg_mode="seq-mean-token-mean")
def sapo_loss(inputs: PaddedInputs, config: SAPOConfig) -> LossTerms:
    lp_BT, adv_BT = inputs.logprobs_BT, inputs.advantages_BT
    with torch.no_grad():
        tau_BT = where_scalars(adv_BT >= 0, config.tau_pos, config.tau_neg, like=lp_BT)
        gate_BT, weight_BT = sapo_gate_and_weight(lp_BT - inputs.old_logprobs_BT, tau_BT)
    loss_BT = -adv_BT * (gate_BT + weight_BT * (lp_BT - lp_BT.detach()))
    metrics = {
        "grad_weight_mean": masked_mean(weight_BT, inputs.mask_BT),
        "grad_weight_below_0.5_frac": masked_mean(
            (weight_BT < 0.5).to(lp_BT.dtype), inputs.mask_BT
        ),
    }
    return LossTerms(loss_BT, metrics)
