"""Rollout corrections: per-token weights and masks for the train/inference mismatch.

When the rollout engine's log-probs ``log mu_rollout`` differ from the trainer's old-policy
log-probs ``log pi_old`` (different kernels, bf16, MoE routing), the per-token loss can be
reweighted by ``rho = pi_old / mu_rollout`` (Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training"):

* ``tis-token``: truncated IS, ``w_t = min(rho_t, cap)``;
* ``tis-seq``: ``w_t = min(rho_seq, cap)`` with ``rho_seq = exp(sum_t log rho_t)``;
* ``mis-token`` / ``icepop``: masked IS, ``w_t = rho_t`` if ``low <= rho_t <= high`` else the
  token leaves the loss mask (IcePop, Ling Team 2025 "Every Step Evolves: Scaling RL for
  Trillion-Scale Thinking Model", with ``[0.5, 5.0]``);
* ``mis-seq``: the same test on ``rho_seq``; a rejected sequence leaves the mask entirely.
* ``decoupled``: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy
  optimization"; AReaL's proximal policy). The loss clips against the proximal policy, the
  trainer's recompute ``pi_old`` (``--behavior-logprobs trainer``), and each token's loss is
  multiplied by the behaviour weight ``w_t = pi_old / mu``; a token with ``w_t > high`` gets
  weight 0 but stays in the denominator (AReaL's ``behav_imp_weight_cap``: masked, not
  truncated, over the original token count).
* ``m2po``: M2PO (Zheng et al. 2025, "Prosperity before Collapse"; AReaL's ``m2_threshold``).
  Over the micro-batch's tokens in the mask, ``m2_t = (log mu - log pi_old)^2`` sorted
  descending; the k largest leave the mask (and the denominator), k the first index at which
  the mean of the remaining ``m2`` is below ``tau`` (all but the smallest when none is); then
  the ``decoupled`` weights on the tokens kept. Ties are broken by position (a stable sort).

Weights are detached and computed as ``exp(clamp(log rho))``, so they never overflow. Combine with
any loss: ``compute_policy_loss(..., loss_mask=c.loss_mask, token_weights=c.weights)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PackedLayout
from megatron_rl.losses.log_space import masked_mean

ROLLOUT_CORRECTIONS = (
    "tis-token",
    "tis-seq",
    "mis-token",
    "mis-seq",
    "icepop",
    "decoupled",
    "m2po",
)
DECOUPLED_CORRECTIONS = ("decoupled", "m2po")  # clip against the trainer's pi_old, weight by mu


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutCorrectionConfig:
    mode: str
    cap: float = 2.0  # tis-*: truncation level C
    low: float = 0.5  # mis-* / icepop: smallest accepted ratio
    high: float = 5.0  # mis-* / icepop: largest accepted ratio; decoupled / m2po: weight cap
    tau: float = 0.04  # m2po: bound on the mean second moment of the kept log-ratios

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"mode={self.mode!r} is unknown; choose one of {ROLLOUT_CORRECTIONS}")
        if not (math.isfinite(self.cap) and self.cap > 0):
            raise ValueError(f"cap must be finite and > 0, got {self.cap}")
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"tau must be finite and > 0, got {self.tau}")
        if not (0 <= self.low <= 1 <= self.high < math.inf):
            raise ValueError(
                f"need 0 <= low <= 1 <= high < inf, got low={self.low}, high={self.high}"
            )


@dataclass(slots=True)
class RolloutCorrection:
    weights: torch.Tensor  # same shape as the inputs, detached, 0 outside the returned mask
    loss_mask: torch.Tensor  # bool, the input mask minus rejected tokens/sequences
    metrics: dict[str, torch.Tensor]  # "rollout_correction/..."


@torch.no_grad()
def rollout_correction(
    mode: str,
    *,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    **options: float,
) -> RolloutCorrection:
    """Weights ``[B, T]`` (or packed ``[N]`` with ``cu_seqlens``) correcting rollout mismatch.

    ``options`` are ``cap`` (tis, default 2.0) and ``low``/``high`` (mis/icepop, default 0.5/5.0).
    """
    config = RolloutCorrectionConfig(mode=mode, **options)
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must match"
        )
    mask = loss_mask.bool()
    dtype = torch.float64 if old_logprobs.dtype == torch.float64 else torch.float32
    diff = old_logprobs.to(dtype) - rollout_logprobs.to(dtype)
    bad = mask & ~torch.isfinite(diff)
    if bool(bad.any()):
        raise ValueError(
            "old_logprobs or rollout_logprobs has non-finite values inside loss_mask (first at "
            f"{[int(i) for i in bad.nonzero()[0]]})"
        )
    log_rho = torch.where(mask, diff, diff.new_zeros(()))
    if mode.endswith("-seq"):
        log_rho = _broadcast_sequence_sum(log_rho, cu_seqlens)
    extra = {}
    if mode.startswith("tis"):
        weights = torch.exp(log_rho.clamp(max=math.log(config.cap)))
        kept = mask
        limited = mask & (log_rho > math.log(config.cap))
    elif mode in DECOUPLED_CORRECTIONS:
        kept = mask
        if mode == "m2po":
            dropped = m2po_dropped(log_rho, mask, config.tau)
            kept = mask & ~dropped
            extra["rollout_correction/m2po_masked_frac"] = masked_mean(dropped.to(dtype), mask)
        inside = log_rho <= math.log(config.high)
        weights = torch.where(inside, torch.exp(log_rho.clamp(max=math.log(config.high))), 0.0)
        limited = kept & ~inside  # weight 0, still counted: AReaL's capped tokens
    else:
        log_low = math.log(config.low) if config.low > 0 else -math.inf
        inside = (log_rho >= log_low) & (log_rho <= math.log(config.high))
        kept = mask & inside
        weights = torch.exp(log_rho.clamp(min=log_low, max=math.log(config.high)))
        limited = mask & ~inside
    weights = torch.where(kept, weights, weights.new_zeros(()))
    k3 = torch.expm1(-log_rho.clamp(-20, 20)) + log_rho.clamp(-20, 20)
    metrics = {
        "rollout_correction/log_ratio_mean": masked_mean(diff.nan_to_num(), mask),
        "rollout_correction/k3_kl": masked_mean(k3, mask),
        "rollout_correction/weight_mean": masked_mean(weights, kept),
        "rollout_correction/limited_frac": masked_mean(limited.to(dtype), mask),
        **extra,
    }
    return RolloutCorrection(weights.to(old_logprobs.dtype), kept, metrics)


def m2po_dropped(log_rho: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """bool, ``mask``'s shape: M2PO's dropped tokens (module docstring). ``log_rho``: the
    log-ratio ``log pi_old - log mu`` (its square is the second moment's term)."""
    m2 = log_rho[mask].double().square()
    dropped = torch.zeros_like(mask)
    n = m2.numel()
    if n == 0:
        return dropped
    ordered, order = m2.sort(descending=True, stable=True)
    # remaining_mean[k]: mean of m2 after dropping the k largest (k = 0 .. n-1)
    tail_sums = ordered.flip(0).cumsum(0).flip(0)
    remaining_mean = tail_sums / torch.arange(n, 0, -1, dtype=m2.dtype, device=m2.device)
    below = (remaining_mean < tau).nonzero()
    k = int(below[0]) if below.numel() else n - 1
    flat = torch.zeros(n, dtype=torch.bool, device=mask.device)
    flat[order[:k]] = True
    dropped[mask] = flat
    return dropped


def _broadcast_sequence_sum(values: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    if cu_seqlens is None:
        if values.dim() != 2:
            raise ValueError("padded inputs must be [B, T]; pass cu_seqlens for packed [N] inputs")
        return values.sum(dim=-1, keepdim=True).expand_as(values)
    layout = PackedLayout.from_cu_seqlens(cu_seqlens, values.shape[0])
    return layout.to_packed(
        layout.to_padded(values).sum(dim=-1, keepdim=True).expand(-1, layout.max_len)
    )
