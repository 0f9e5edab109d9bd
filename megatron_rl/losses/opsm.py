"""Off-policy sequence masking (OPSM; DeepSeek-V3.2's report, slime/miles ``--use-opsm``).

A sequence with a negative advantage whose policy has drifted from its behaviour policy leaves
the policy loss:

    D_i = sum_t m_it (log pi_b(o_t) - log pi_theta(o_t)) / max(sum_t m_it, 1)
    keep_it = 0  if  A_it < 0  and  D_i > delta,  else 1

``pi_b`` is the loss's behaviour policy (the engine's mu with ``--behavior-logprobs rollout``,
the trainer's recompute otherwise, as slime's ``--use-rollout-logprobs`` chooses), ``pi_theta``
the current policy at this update, so the mask is recomputed at every update (no gradient flows
through it). The test on ``A`` is per token, as in slime (for sequence advantages the same for
every token of a sequence). A masked token's loss is multiplied by 0 and it stays in the
denominator (slime multiplies ``pg_loss`` by the mask and keeps its loss-mask sums).
"""

from __future__ import annotations

import math

import torch

from megatron_rl.losses.log_space import masked_mean

OPSM_DEFAULT_DELTA = 1e-4  # slime's --opsm-delta default


def check_delta(delta: float) -> None:
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"--opsm-delta {delta!r}: must be a finite number >= 0")


@torch.no_grad()
def opsm_keep(
    logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    delta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(keep_BT, metrics)``: the float {0, 1} multiplier of each token's loss (formula above)
    and ``opsm/masked_token_frac``, ``opsm/masked_seq_frac`` (sequences with a token in the mask)
    and ``opsm/seq_kl_mean`` (mean D_i over those sequences). ``advantages``: ``[B]`` or
    ``[B, T]``."""
    check_delta(delta)
    mask = loss_mask_BT.bool()
    dtype = torch.float64 if logprobs_BT.dtype == torch.float64 else torch.float32
    drift_BT = torch.where(mask, behaviour_logprobs_BT.to(dtype) - logprobs_BT.to(dtype), 0.0)
    tokens_B = mask.sum(dim=-1)
    seq_kl_B = drift_BT.sum(dim=-1) / tokens_B.clamp(min=1)
    adv_BT = advantages[:, None] if advantages.dim() == 1 else advantages
    masked_BT = (adv_BT < 0) & (seq_kl_B[:, None] > delta) & mask
    has_tokens = tokens_B > 0
    metrics = {
        "opsm/masked_token_frac": masked_mean(masked_BT.to(dtype), mask),
        "opsm/masked_seq_frac": masked_mean(masked_BT.any(dim=-1).to(dtype), has_tokens),
        "opsm/seq_kl_mean": masked_mean(seq_kl_B, has_tokens),
    }
    return (~masked_BT).to(logprobs_BT.dtype), metrics
