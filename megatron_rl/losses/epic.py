"""EPIC (Li et al. 2026, "EPIC: Rethinking Trust Regions for Autoregressive LLM Policies via
Exact-KL Prefix Importance-Ratio Clipping", arXiv 2610.29999).

For response token ``t`` (1-based, counted over the masked-in tokens of the sequence):

* prefix log-ratio ``L_t = sum_{k<=t} (log pi_theta - log mu)`` and its geometric mean
  ``g_t = exp(L_t / t)`` (Sec. 3.3, App. 8.1);
* calibrated bounds (App. 7.3): ``phi(l_t) = t delta_low / mu_t^(1/t)`` and
  ``phi(u_t) = t delta_high / mu_t^(1/t)`` with ``phi(R) = R - 1 - log R``, ``0 < l_t <= 1 <= u_t``
  and ``mu_t^(1/t) = exp(mean_{k<=t} log mu)``; the clip acts on ``g_t`` between ``l_t^(1/t)`` and
  ``u_t^(1/t)``;
* straight-through current-token gradient (App. 8.1):
  ``g~_t = sg[g_t] * pi_theta(y_t) / sg[pi_theta(y_t)]``;
* sign-aware clip (App. 8.2): ``S_t = A min(g~_t, u_t^(1/t))`` for ``A >= 0`` and
  ``S_t = A clip(g~_t, l_t^(1/t), u_t^(1/t))`` for ``A < 0``; ``l_t = -S_t``. Its gradient is
  ``A g_t grad log pi_t`` times ``1{g_t < u}`` (``A >= 0``) or ``1{l < g_t < u}`` (``A < 0``).

The roots are found in ``x = log R`` (``e^x - 1 - x = c``) by Newton's method in float64 from
closed-form starting points, ``EPIC_NEWTON_STEPS`` steps (relative error < 1e-10 for
``c`` in [1e-10, 1e12], tested against 60-step solutions). Numerics: ``c`` is used in log space
(``log c = log t + log delta - mean log mu``); ``log l^(1/t)`` is floored at ``-1e4`` (its
exponential is 0 either way) and ``log u^(1/t)`` is capped at ``LOG_RATIO_CAP`` (20), which
only changes bounds wider than ``e^20``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import LOG_RATIO_CAP, masked_mean
from megatron_rl.losses.registry import LossTerms, register_policy_loss

EPIC_NEWTON_STEPS = 4
_LOG_C_MIN, _LOG_C_MAX = -600.0, 700.0


@dataclass(frozen=True, kw_only=True, slots=True)
class EPICConfig:
    delta_low: float = 5e-4
    delta_high: float = 2e-3

    def __post_init__(self) -> None:
        for field_name in ("delta_low", "delta_high"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{field_name} (KL budget) must be finite and > 0, got {value}")


def _newton(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    for _ in range(EPIC_NEWTON_STEPS):
        e = torch.expm1(x)
        x = x - (e - x - c) / e
    return x


def reverse_kl_roots(log_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both roots ``x_low <= 0 <= x_up`` of ``e^x - 1 - x = c`` (``R = e^x``), given ``log c``.

    float64 in and out; any finite ``log_c``.
    """
    c = torch.exp(log_c.clamp(_LOG_C_MIN, _LOG_C_MAX))
    s = torch.sqrt(2 * c)
    # lower root: series -s - s^2/6 - s^3/72 near 0, -(c+1) + e^-(c+1) for large c
    x_low = torch.where(c < 2, -s - s * s / 6 - s**3 / 72, torch.expm1(-(c + 1)) - c)
    x_low = _newton(x_low, c)
    # upper root: log1p(c + s) lies right of the root; Newton from there is monotone
    x_up = _newton(torch.log1p(c + s), c)
    x_up = torch.where(log_c > _LOG_C_MAX, log_c, x_up)  # x = log c + O(log c / c) there
    return x_low, x_up


@torch.no_grad()
def epic_log_bounds(
    old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, delta_low: float, delta_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log l_t^(1/t)``, ``log u_t^(1/t)`` and ``t`` for every position, all ``[B, T]`` float64."""
    mask = mask_BT.to(torch.float64)
    t_BT = torch.cumsum(mask, dim=-1).clamp(min=1)
    mean_log_mu_BT = torch.cumsum(old_logprobs_BT.to(torch.float64) * mask, dim=-1) / t_BT
    log_c_base_BT = torch.log(t_BT) - mean_log_mu_BT
    x_low, _ = reverse_kl_roots(log_c_base_BT + math.log(delta_low))
    _, x_up = reverse_kl_roots(log_c_base_BT + math.log(delta_high))
    log_lower = (x_low / t_BT).clamp(min=-1e4)
    log_upper = (x_up / t_BT).clamp(max=LOG_RATIO_CAP)
    return log_lower, log_upper, t_BT


@register_policy_loss("epic", config=EPICConfig, default_agg_mode="seq-mean-token-mean")
def epic_loss(inputs: PaddedInputs, config: EPICConfig) -> LossTerms:
    lp_BT, mask_BT, adv_BT = inputs.logprobs_BT, inputs.mask_BT, inputs.advantages_BT
    dtype = lp_BT.dtype
    log_lower, log_upper, t_BT = epic_log_bounds(
        inputs.old_logprobs_BT, mask_BT, config.delta_low, config.delta_high
    )
    with torch.no_grad():
        prefix_log_ratio_BT = torch.cumsum((lp_BT - inputs.old_logprobs_BT).double(), dim=-1)
        log_g = (prefix_log_ratio_BT / t_BT).to(dtype)
        log_lower, log_upper = log_lower.to(dtype), log_upper.to(dtype)
        below_upper = log_g < log_upper
        inside = below_upper & (log_g > log_lower)
        negative = adv_BT < 0
        active = torch.where(negative, inside, below_upper)
        log_clipped = torch.where(negative, log_g.clamp(log_lower, log_upper), log_upper)
    log_g_st = log_g + (lp_BT - lp_BT.detach())  # value log g_t, gradient d log pi_t
    log_q = torch.where(active, log_g_st, log_clipped)
    loss_BT = -adv_BT * torch.exp(log_q)
    with torch.no_grad():
        metrics = {
            "clip_frac_high": masked_mean((~below_upper).to(dtype), mask_BT),
            "clip_frac_low": masked_mean((negative & (log_g <= log_lower)).to(dtype), mask_BT),
            "log_upper_mean": masked_mean(log_upper, mask_BT),
            "log_lower_mean": masked_mean(log_lower, mask_BT),
            "prefix_log_ratio_abs_mean": masked_mean(prefix_log_ratio_BT.abs().to(dtype), mask_BT),
        }
    return LossTerms(loss_BT, metrics)
