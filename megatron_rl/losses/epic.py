"""EPIC (Li et al. 2026, "EPIC: Rethinking Trust Regions for Autoregressive LLM Policies via
Exact-KL Prefix Importance-Ratio Clipping", arXiv 2610.29999).

For response token ``t`` (1-based, counted over the masked-in tokens of the sequence):

* prefix log-ratio ``L_t = sum_{k<=t} (log pi_theta - log mu)``, prefix ratio
  ``r_pre = exp(L_t)`` (Sec. 3.1) and its geometric mean ``g_t = exp(L_t / t)`` (App. 8.1);
* calibrated bounds (App. 7.3): ``phi(l_t) = t delta_low / mu_t^(1/t)`` and
  ``phi(u_t) = t delta_high / mu_t^(1/t)`` with ``phi(R) = R - 1 - log R``, ``0 < l_t <= 1 <= u_t``
  and ``mu_t^(1/t) = exp(mean_{k<=t} log mu)``; the clip acts on ``g_t`` between ``l_t^(1/t)`` and
  ``u_t^(1/t)``;
* straight-through current-token gradient (App. 8.1):
  ``g~_t = sg[g_t] * pi_theta(y_t) / sg[pi_theta(y_t)]``;
* clip operator ``S_t = C(q, A; l, u)`` at ``q = g~_t``, ``l = l_t^(1/t)``, ``u = u_t^(1/t)``;
  the per-token loss is ``-S_t`` and its gradient is ``A g_t grad log pi_t`` times an
  indicator. ``variant`` chooses the operator, or one of the paper's ablations (App. 10.4,
  Table 3), which keep the dual operator:

  - ``"dual"`` (default): the paper's sign-aware operator (Sec. 3.3, App. 8.2),
    ``C = A min(q, u)`` for ``A >= 0`` and ``C = A clip(q, l, u)`` for ``A < 0``; indicator
    ``1{g_t < u}`` (``A >= 0``) or ``1{l < g_t < u}`` (``A < 0``), i.e. a negative-advantage
    token is also cut off above ``u``;
  - ``"plain"``: the ordinary PPO pessimistic clip on the same ratio and bounds,
    ``C = min(q A, clip(q, l, u) A)``, which is ``A min(q, u)`` for ``A >= 0`` (as in dual) and
    ``A max(q, l)`` for ``A < 0``; indicator ``1{g_t < u}`` (``A >= 0``) or ``1{g_t > l}``
    (``A < 0``), so a negative-advantage token above ``u`` keeps its gradient;
  - ``"raw-prob"`` (Table 3, "Raw-prob"): the budget is calibrated with the unnormalised
    cumulative behaviour probability, ``phi(l_t) = t delta_low / mu(y_1:t)`` and
    ``phi(u_t) = t delta_high / mu(y_1:t)`` (``log c = log t + log delta - sum_{k<=t} log mu``);
    ratio, operator and gradient as in dual (``q = g~_t`` against ``l_t^(1/t)``,
    ``u_t^(1/t)``). ``1 / mu(y_1:t)`` grows exponentially with ``t``, so the bounds open up
    after the first tokens and the clip acts almost only at the start of a long response;
  - ``"cumulative-ratio"`` (Table 3, "Cumulative-ratio"): the default calibration, but the
    objective uses the prefix ratio itself, ``S_t = C(r~_t, A; l_t, u_t)`` with
    ``r~_t = sg[r_pre] * pi_theta(y_t) / sg[pi_theta(y_t)]`` (value ``r_pre``, gradient
    ``A r_pre grad log pi_t``) and the dual operator on ``[l_t, u_t]`` (not their ``1/t`` powers).

  Metrics ``clip_frac_high`` / ``clip_frac_low`` count the tokens whose gradient the upper /
  lower bound removes under the chosen operator; ``clipped_BT`` is their union.

Computation: whether a token is clipped needs no root. For every variant the clip test is
``L_t >= x_up`` (above ``u``) or ``L_t <= x_low`` (below ``l``), ``x = log R`` of the two roots,
since ``g_t >= u_t^(1/t)`` iff ``L_t >= log u_t``; and ``L_t >= x_up`` iff ``L_t > 0`` and
``phi(e^L_t) >= c_high`` (``phi`` is increasing on ``R > 1``; symmetrically below with
``c_low``), a test that is exact and cheap (``log phi(e^L)`` is evaluated as
``L + log1p(-(1 + L) e^-L)`` for ``L > 30``, so a prefix ratio beyond float64 is still tested
against a bound beyond it, as raw-prob's are). The roots are solved only for the clipped tokens,
whose loss takes the bound's value: in ``x = log R`` (``e^x - 1 - x = c``) by Newton's method in
float64 from closed-form starting points, ``EPIC_NEWTON_STEPS`` steps (relative error < 1e-9 for
``c`` in [1e-9, 1e8], tested against bisection; for ``log c > 700``, reached by raw-prob on long
responses, ``x_up = log c`` to within ``log c / c`` and ``e^(x_low)`` underflows to 0). ``c`` is
handled in log space. Bounds: ``log l`` (of whichever ratio is clipped) is floored at ``-1e4``
(its exponential is 0 either way) and the ratio values and upper bounds are capped at
``e^LOG_RATIO_CAP`` (e^20) like every ratio in this package; nothing else is approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import LOG_RATIO_CAP, capped_exp, masked_mean
from megatron_rl.losses.registry import LossTerms, register_policy_loss

EPIC_NEWTON_STEPS = 4
EPIC_VARIANTS = ("dual", "plain", "raw-prob", "cumulative-ratio")
_LOG_C_MIN, _LOG_C_MAX = -600.0, 700.0


@dataclass(frozen=True, kw_only=True, slots=True)
class EPICConfig:
    delta_low: float = 5e-4
    delta_high: float = 2e-3
    variant: str = "dual"

    def __post_init__(self) -> None:
        if self.variant not in EPIC_VARIANTS:
            raise ValueError(f"variant={self.variant!r} is unknown; choose one of {EPIC_VARIANTS}")
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


def _log_c_base(sum_log_mu_BT: torch.Tensor, t_BT: torch.Tensor, variant: str) -> torch.Tensor:
    """``log(t / mu_t^(1/t))``, or ``log(t / mu(y_1:t))`` for raw-prob (add ``log delta``)."""
    if variant == "raw-prob":
        return torch.log(t_BT) - sum_log_mu_BT
    return torch.log(t_BT) - sum_log_mu_BT / t_BT


def _ratio_power(t_BT: torch.Tensor, variant: str) -> torch.Tensor:
    """Divisor of ``log r_pre`` giving the clipped ratio: ``t`` (``g_t``), or 1 (``r_pre``)."""
    return torch.ones_like(t_BT) if variant == "cumulative-ratio" else t_BT


@torch.no_grad()
def epic_log_bounds(
    old_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    delta_low: float,
    delta_high: float,
    variant: str = "dual",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log of the lower and upper bound on the clipped ratio, and ``t``, all ``[B, T]`` float64.

    The bounds are ``l_t^(1/t)``, ``u_t^(1/t)`` (dual, plain, raw-prob: the latter with its own
    calibration) or ``l_t``, ``u_t`` (cumulative-ratio).
    """
    EPICConfig(delta_low=delta_low, delta_high=delta_high, variant=variant)  # validates
    mask = mask_BT.to(torch.float64)
    t_BT = torch.cumsum(mask, dim=-1).clamp(min=1)
    sum_log_mu_BT = torch.cumsum(old_logprobs_BT.to(torch.float64) * mask, dim=-1)
    log_c_base_BT = _log_c_base(sum_log_mu_BT, t_BT, variant)
    x_low, _ = reverse_kl_roots(log_c_base_BT + math.log(delta_low))
    _, x_up = reverse_kl_roots(log_c_base_BT + math.log(delta_high))
    power_BT = _ratio_power(t_BT, variant)
    log_lower = (x_low / power_BT).clamp(min=-1e4)
    log_upper = (x_up / power_BT).clamp(max=LOG_RATIO_CAP)
    return log_lower, log_upper, t_BT


def _log_phi(log_r: torch.Tensor) -> torch.Tensor:
    """``log phi(e^x) = log(e^x - 1 - x)`` without overflow (``+inf`` nowhere for finite x)."""
    large = log_r + torch.log1p(-(1 + log_r) * torch.exp(-log_r))  # e^x - 1 - x = e^x (1 - ...)
    return torch.where(log_r > 30, large, torch.log(torch.expm1(log_r) - log_r))


@torch.no_grad()
def _clip_regions(
    prefix_log_ratio_BT: torch.Tensor, log_c_base_BT: torch.Tensor, config: EPICConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``L_t >= x_up`` and where ``L_t <= x_low``, without solving for the roots.

    ``L_t >= x_up`` iff ``L_t > 0`` and ``phi(e^L_t) >= c_high`` (``phi`` is increasing on
    ``R > 1``); likewise ``L_t <= x_low`` with ``L_t < 0`` and ``c_low``. Whether the clipped
    ratio is ``g_t`` (bounds ``l^(1/t)``, ``u^(1/t)``) or ``r_pre`` (bounds ``l``, ``u``), this is
    the same event. The test is exact (no root-finding error) and costs a few elementwise
    operations.
    """
    log_phi = _log_phi(prefix_log_ratio_BT)
    above_upper = (prefix_log_ratio_BT > 0) & (
        log_phi >= log_c_base_BT + math.log(config.delta_high)
    )
    below_lower = (prefix_log_ratio_BT < 0) & (
        log_phi >= log_c_base_BT + math.log(config.delta_low)
    )
    return above_upper, below_lower


@register_policy_loss("epic", config=EPICConfig, default_agg_mode="seq-mean-token-mean")
def epic_loss(inputs: PaddedInputs, config: EPICConfig) -> LossTerms:
    lp_BT, mask_BT, adv_BT = inputs.logprobs_BT, inputs.mask_BT, inputs.advantages_BT
    dtype = lp_BT.dtype
    with torch.no_grad():
        mask64 = mask_BT.to(torch.float64)
        t_BT = torch.cumsum(mask64, dim=-1).clamp(min=1)
        power_BT = _ratio_power(t_BT, config.variant)  # clipped ratio = exp(L_t / power)
        log_ratio64 = (lp_BT.detach() - inputs.old_logprobs_BT).to(torch.float64)
        prefix_BT = torch.cumsum(log_ratio64, dim=-1)
        sum_log_mu_BT = torch.cumsum(inputs.old_logprobs_BT.to(torch.float64), dim=-1)
        log_c_base_BT = _log_c_base(sum_log_mu_BT, t_BT, config.variant)
        above_upper, below_lower = _clip_regions(prefix_BT, log_c_base_BT, config)
        negative = adv_BT < 0
        clip_low = negative & below_lower & mask_BT
        clip_high = above_upper & mask_BT
        if config.variant == "plain":  # A < 0 is clipped only below l
            clip_high = clip_high & ~negative
        # clipped tokens take the bound's value: solve for the roots only there
        log_clipped = torch.zeros_like(prefix_BT)
        if bool(clip_high.any()):
            _, x_up = reverse_kl_roots(log_c_base_BT[clip_high] + math.log(config.delta_high))
            log_clipped[clip_high] = (x_up / power_BT[clip_high]).clamp(max=LOG_RATIO_CAP)
        if bool(clip_low.any()):
            x_low, _ = reverse_kl_roots(log_c_base_BT[clip_low] + math.log(config.delta_low))
            log_clipped[clip_low] = (x_low / power_BT[clip_low]).clamp(min=-1e4)
        active = ~(clip_high | clip_low)
        log_q = (prefix_BT / power_BT).to(dtype)
    log_q_st = log_q + (lp_BT - lp_BT.detach())  # value log q, gradient d log pi_t
    q_BT = torch.where(active, capped_exp(log_q_st), torch.exp(log_clipped.to(dtype)))
    loss_BT = -adv_BT * q_BT
    with torch.no_grad():
        metrics = {
            "clip_frac_high": masked_mean(clip_high.to(dtype), mask_BT),
            "clip_frac_low": masked_mean(clip_low.to(dtype), mask_BT),
            "prefix_log_ratio_abs_mean": masked_mean(prefix_BT.abs().to(dtype), mask_BT),
        }
    return LossTerms(loss_BT, metrics, clip_high | clip_low)
