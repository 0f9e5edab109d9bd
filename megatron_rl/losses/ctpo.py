"""CTPO (Zhang et al. 2026, "Rethinking Importance Sampling in LLM Policy Optimization: A
Cumulative Token Perspective", arXiv 2605.07331): the cumulative token ratio with
position-adaptive log-space clipping (the paper's CTPO-LA, ``cum-token-cumprod-la``).

For response token ``t`` (1-based, counted over the masked-in tokens of the sequence):

* cumulative token ratio (Sec. 3): ``rho_t = prod_{k<=t} pi_theta(y_k)/mu(y_k) = exp(L_t)``,
  ``L_t = sum_{k<=t} (log pi_theta - log mu)``;
* token-level policy-gradient form: the prefix is a detached weight and the gradient flows
  through the current token only, ``rho~_t = sg[rho_t] pi_theta(y_t) / sg[pi_theta(y_t)]`` (the
  paper's "unbiased prefix correction for each token-level gradient term"), so an unclipped
  token contributes ``A rho_t grad log pi_t``;
* position-adaptive log-space bounds (Sec. 3, ``Var(log rho_t)`` grows like ``t``):
  ``rho_t in [exp(-clip_low t^p), exp(clip_high t^p)]`` with ``p = position_power = 1/2``;
* per-token loss ``-min(rho~_t A, clip(rho~_t, e^(-clip_low t^p), e^(clip_high t^p)) A)``,
  i.e. ``-A min(rho, u_t)`` for ``A >= 0`` and ``-A max(rho, l_t)`` for ``A < 0``;
* dual clip for ``A < 0`` (official code): the loss is capped at ``-A exp(log_clip_c t^p)``, so a
  negative-advantage token with ``rho_t > exp(log_clip_c t^p)`` loses its gradient;
  ``log_clip_c=inf`` switches it off (the objective exactly as the paper writes it).

Sources: the paper's abstract and Sec. 3 as summarised in public notes (the objective
``1/G sum_i 1/|o_i| sum_t min(rho A, clip(rho, e^-eps_low(t), e^eps_high(t)) A)`` with
``eps(t) = eps t^0.5``); the authors' code (github.com/horizon-llm/CTPO, ``core_algos.py``
``_compute_policy_loss_cum_token_la_impl`` and ``ctpo.sh``) for the stop-gradient, the dual clip
and the defaults. The paper's text itself was not reachable here, so no equation numbers are
given. Defaults are the official ones, ``clip_low=0.025, clip_high=0.05, log_clip_c=0.05,
position_power=0.5``; the EPIC paper's Table 2 (arXiv 2610.29999) lists CTPO's clipping
parameters as the same 0.025 / 0.05. Default aggregation is the paper's sequence-mean of token
means (the official script runs verl's ``token-mean``; pass ``loss_agg_mode`` to match it).

Differences from the official code (stated approximations): its guards ``log r_k`` in [-20, 20]
before the prefix sum and ``log rho <= 10`` are not copied; instead ``L_t`` is summed in float64
and, like every ratio in this package, an unclipped ``rho_t`` and the bounds are capped at
``e^LOG_RATIO_CAP`` (e^20). Metrics ``clip_frac_high`` / ``clip_frac_low`` / ``dual_clip_frac``
count the tokens whose gradient the upper bound (``A > 0``), the lower bound (``A < 0``) and the
dual clip (``A < 0``) remove; ``clipped_BT`` is their union.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import LOG_RATIO_CAP, capped_exp, masked_mean
from megatron_rl.losses.registry import LossTerms, register_policy_loss


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class CTPOConfig:
    clip_low: float = 0.025  # log-space lower bound base: rho_t >= exp(-clip_low t^p)
    clip_high: float = 0.05  # log-space upper bound base: rho_t <= exp(clip_high t^p)
    log_clip_c: float = 0.05  # dual clip for A < 0 at exp(log_clip_c t^p); inf: off
    position_power: float = 0.5  # p; 0 gives position-independent bounds

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if not (_is_real(value) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{name} (log-space clip base of CTPO) must be a finite number > 0, got "
                    f"{value!r}"
                )
        c = self.log_clip_c
        if not (_is_real(c) and c > 0):  # nan fails too
            raise ValueError(
                f"log_clip_c (CTPO dual clip, log-space base) must be a number > 0, or inf to "
                f"switch the dual clip off, got {c!r}"
            )
        p = self.position_power
        if not (_is_real(p) and math.isfinite(p)):
            raise ValueError(
                f"position_power (exponent of t in the bounds) must be finite, got {p!r}"
            )


@torch.no_grad()
def ctpo_log_bounds(
    mask_BT: torch.Tensor, config: CTPOConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``log l_t = -clip_low t^p``, ``log u_t = clip_high t^p`` and the dual clip's
    ``log_clip_c t^p`` (None when off), ``[B, T]`` float64, ``t`` = 1-based masked position."""
    t_BT = torch.cumsum(mask_BT.to(torch.float64), dim=-1).clamp(min=1)
    scale_BT = t_BT**config.position_power
    log_dual = None if math.isinf(config.log_clip_c) else config.log_clip_c * scale_BT
    return -config.clip_low * scale_BT, config.clip_high * scale_BT, log_dual


@register_policy_loss("ctpo", config=CTPOConfig, default_agg_mode="seq-mean-token-mean")
def ctpo_loss(inputs: PaddedInputs, config: CTPOConfig) -> LossTerms:
    lp_BT, mask_BT, adv_BT = inputs.logprobs_BT, inputs.mask_BT, inputs.advantages_BT
    dtype = lp_BT.dtype
    with torch.no_grad():
        log_ratio64 = (lp_BT.detach() - inputs.old_logprobs_BT).to(torch.float64)
        prefix_BT = torch.cumsum(log_ratio64, dim=-1)  # L_t; zero outside the mask
        log_lower, log_upper, log_dual = ctpo_log_bounds(mask_BT, config)
        positive, negative = (adv_BT > 0) & mask_BT, (adv_BT < 0) & mask_BT
        clip_high = positive & (prefix_BT > log_upper)
        clip_low = negative & (prefix_BT < log_lower)
        dual = torch.zeros_like(mask_BT) if log_dual is None else negative & (prefix_BT > log_dual)
        log_bound = torch.where(clip_high, log_upper, log_lower)
        if log_dual is not None:
            log_bound = torch.where(dual, log_dual, log_bound)
        log_bound = log_bound.clamp(max=LOG_RATIO_CAP)
        clipped = clip_high | clip_low | dual
    log_rho_st = prefix_BT.to(dtype) + (lp_BT - lp_BT.detach())  # value L_t, grad d log pi_t
    q_BT = torch.where(clipped, torch.exp(log_bound.to(dtype)), capped_exp(log_rho_st))
    loss_BT = -adv_BT * q_BT
    with torch.no_grad():
        metrics = {
            "clip_frac_high": masked_mean(clip_high.to(dtype), mask_BT),
            "clip_frac_low": masked_mean(clip_low.to(dtype), mask_BT),
            "dual_clip_frac": masked_mean(dual.to(dtype), mask_BT),
            "prefix_log_ratio_abs_mean": masked_mean(prefix_BT.abs().to(dtype), mask_BT),
        }
    return LossTerms(loss_BT, metrics, clipped_BT=clipped)
