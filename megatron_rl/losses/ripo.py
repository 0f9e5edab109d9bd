"""RIPO (Cai et al. 2026, "Beyond Euclidean Clipping: Overcoming Exploration Collapse in LLM RL
via Riemannian Isometric Policy Optimization", ICML 2026, arXiv 2607.10169): the token-level PPO
clip with Riemannian Isometric Clip (RIC) bounds that depend on the behaviour probability.

Derivation (Sec. 3-4): to second order the KL divergence is the Fisher metric, so moving one
token's ratio ``r = pi_theta(a|s) / mu(a|s)`` costs ``d_geom = 1/2 mu(a|s) (r - 1)^2``; PPO's
fixed ``|r - 1| <= eps`` spends almost none of the trust region on rare tokens and a lot on
likely ones. Asking every update to move the same geometric distance, ``d_geom <= delta``, and
absorbing the factor 2 into ``delta`` gives the RIC radius (Eq. 11)

    eps(mu) = sqrt(delta / mu(a|s)),

with separate budgets below and above 1 (the paper's ablation of ``(delta_low, delta_high)``).
The objective (Eq. 15) is GRPO/DAPO's token-level clipped surrogate with these bounds and
token-mean aggregation; in the experiments the token ratio is also truncated to
``[ratio_min, ratio_max] = [0.5, 10]``. Per token, with ``r~ = clip(r, ratio_min, ratio_max)``,
``l = max(1 - sqrt(delta_low/mu), ratio_min)`` and ``u = min(1 + sqrt(delta_high/mu), ratio_max)``:

    loss_t = max(-A r~, -A clip(r~, l, u)),

i.e. ``-A min(r~, u)`` for ``A >= 0`` and ``-A max(r~, l)`` for ``A < 0``. The gradient is removed
for ``A > 0`` above ``u`` or below ``ratio_min`` and for ``A < 0`` below ``l`` or above
``ratio_max``: ``clip_frac_high`` / ``clip_frac_low`` count those tokens by side (the truncation
included; ``truncated_frac`` counts the truncation alone) and ``clipped_BT`` is their union.
``ratio_min=0`` / ``ratio_max=inf`` switch the truncation off.

Sources: the primary text was not reachable here. The formula, the equation numbers (11, 15)
and the defaults ``delta = 0.05`` (symmetric) and ``[0.5, 10]`` come from public notes on the
paper (several, consistent) and from a public verl implementation that cites Eq. 11 and states
the order "truncate the token ratio to [0.5, 10], then the RIC interval"; another public
implementation only clamps the bounds ``l, u`` to [0.5, 10] and leaves the unclipped branch
untruncated, which differs from this one only for ``A > 0, r < 0.5`` and ``A < 0, r > 10``
(there it keeps the gradient). The EPIC paper's Table 2 (arXiv 2610.29999) lists RIPO's
clipping parameters as 0.05 / 0.05, the same as ``delta_low / delta_high`` here.

Numerics: the bounds are computed in float64 in log space from ``log mu`` (``log u =
log1p(exp(log eps_high))``, ``log l = log1p(-exp(log eps_low))`` when ``eps_low < 1``), so a rare
token (``log mu = -1e4``) gives ``l = ratio_min`` and ``u = ratio_max`` without overflow. With
``ratio_max=inf`` an unclipped ratio is capped at ``e^LOG_RATIO_CAP`` (e^20) like every ratio in
this package; nothing else is approximated.
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
class RIPOConfig:
    delta_low: float = 0.05  # trust-region budget below 1: l = 1 - sqrt(delta_low / mu)
    delta_high: float = 0.05  # above 1: u = 1 + sqrt(delta_high / mu)
    ratio_min: float = 0.5  # token-ratio truncation floor; 0: none
    ratio_max: float = 10.0  # token-ratio truncation cap; inf: none

    def __post_init__(self) -> None:
        for name in ("delta_low", "delta_high"):
            value = getattr(self, name)
            if not (_is_real(value) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{name} (RIPO trust-region budget delta) must be a finite number > 0, got "
                    f"{value!r}"
                )
        low, high = self.ratio_min, self.ratio_max
        if not (_is_real(low) and 0 <= low < 1):
            raise ValueError(
                f"ratio_min (truncation floor of the token ratio) must be in [0, 1) (0: no floor), "
                f"got {low!r}"
            )
        if not (_is_real(high) and high > 1):  # nan fails too
            raise ValueError(
                f"ratio_max (truncation cap of the token ratio) must be > 1 (inf: no cap), got "
                f"{high!r}"
            )


@torch.no_grad()
def ripo_log_bounds(
    old_logprobs_BT: torch.Tensor, config: RIPOConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log l`` and ``log u`` (float64, ``[B, T]``) of the effective ratio interval: the RIC
    interval ``[1 - sqrt(delta_low/mu), 1 + sqrt(delta_high/mu)]`` inside the truncation."""
    log_mu = old_logprobs_BT.to(torch.float64)
    log_eps_high = 0.5 * (math.log(config.delta_high) - log_mu)
    log_upper = torch.logaddexp(torch.zeros_like(log_eps_high), log_eps_high)
    if not math.isinf(config.ratio_max):
        log_upper = log_upper.clamp(max=math.log(config.ratio_max))
    log_eps_low = 0.5 * (math.log(config.delta_low) - log_mu)
    below_one = log_eps_low < 0  # eps_low < 1: the lower RIC bound 1 - eps_low is positive
    log_lower = torch.where(
        below_one,
        torch.log1p(-torch.exp(log_eps_low.clamp(max=0))),
        log_mu.new_full((), -math.inf),
    )
    if config.ratio_min > 0:
        log_lower = log_lower.clamp(min=math.log(config.ratio_min))
    return log_lower, log_upper


@register_policy_loss("ripo", config=RIPOConfig, default_agg_mode="token-mean")
def ripo_loss(inputs: PaddedInputs, config: RIPOConfig) -> LossTerms:
    lp_BT, mask_BT, adv_BT = inputs.logprobs_BT, inputs.mask_BT, inputs.advantages_BT
    dtype = lp_BT.dtype
    log_ratio_BT = lp_BT - inputs.old_logprobs_BT
    with torch.no_grad():
        x64 = log_ratio_BT.detach().to(torch.float64)
        log_lower, log_upper = ripo_log_bounds(inputs.old_logprobs_BT, config)
        log_min = math.log(config.ratio_min) if config.ratio_min > 0 else -math.inf
        log_max = math.log(config.ratio_max)  # inf for ratio_max=inf
        positive, negative = (adv_BT > 0) & mask_BT, (adv_BT < 0) & mask_BT
        above_u = positive & (x64 > log_upper)  # value u
        below_l = negative & (x64 < log_lower)  # value l
        above_max = negative & (x64 > log_max)  # value ratio_max (truncation)
        below_min = positive & (x64 < log_min)  # value ratio_min (truncation)
        clip_high, clip_low = above_u | above_max, below_l | below_min
        clipped = clip_high | clip_low
        log_bound = torch.where(above_u, log_upper, log_lower)
        log_bound = torch.where(above_max, log_upper.new_full((), log_max), log_bound)
        log_bound = torch.where(below_min, log_upper.new_full((), log_min), log_bound)
        log_bound = log_bound.clamp(max=LOG_RATIO_CAP)
    q_BT = torch.where(clipped, torch.exp(log_bound.to(dtype)), capped_exp(log_ratio_BT))
    loss_BT = -adv_BT * q_BT
    with torch.no_grad():
        metrics = {
            "clip_frac_high": masked_mean(clip_high.to(dtype), mask_BT),
            "clip_frac_low": masked_mean(clip_low.to(dtype), mask_BT),
            "truncated_frac": masked_mean((above_max | below_min).to(dtype), mask_BT),
            "lower_bound_mean": masked_mean(log_lower.exp().to(dtype), mask_BT),
            "upper_bound_mean": masked_mean(
                log_upper.clamp(max=LOG_RATIO_CAP).exp().to(dtype), mask_BT
            ),
        }
    return LossTerms(loss_BT, metrics, clipped_BT=clipped)
