"""Loss-independent diagnostics of the importance ratios (computed without gradient).

* ``log_ratio_{mean,min,max}``: token log-ratios ``log pi_theta - log mu`` over the mask;
* ``seq_log_ratio_{mean,min,max}``: sequence log-weights ``log W_i = sum_t (log pi - log mu)``;
* ``seq_ess``: normalised effective sample size of the sequence weights,
  ``(sum_i W_i)^2 / (n sum_i W_i^2)`` in ``(0, 1]``, evaluated with logsumexp so that it stays
  exact for any ``log W``;
* ``num_tokens`` / ``num_seqs``: the local counts (the denominators when none are given).
"""

from __future__ import annotations

import math

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import masked_extreme, masked_mean


@torch.no_grad()
def importance_metrics(inputs: PaddedInputs) -> dict[str, torch.Tensor]:
    mask_BT = inputs.mask_BT
    log_ratio_BT = inputs.logprobs_BT.detach() - inputs.old_logprobs_BT
    seq_mask_B = mask_BT.any(dim=-1)
    seq_log_w_B = log_ratio_BT.sum(dim=-1)
    num_seqs = seq_mask_B.sum()
    return {
        "log_ratio_mean": masked_mean(log_ratio_BT, mask_BT),
        "log_ratio_min": masked_extreme(log_ratio_BT, mask_BT, largest=False),
        "log_ratio_max": masked_extreme(log_ratio_BT, mask_BT, largest=True),
        "seq_log_ratio_mean": masked_mean(seq_log_w_B, seq_mask_B),
        "seq_log_ratio_min": masked_extreme(seq_log_w_B, seq_mask_B, largest=False),
        "seq_log_ratio_max": masked_extreme(seq_log_w_B, seq_mask_B, largest=True),
        "seq_ess": normalized_ess(seq_log_w_B, seq_mask_B),
        "num_tokens": mask_BT.sum().to(log_ratio_BT.dtype),
        "num_seqs": num_seqs.to(log_ratio_BT.dtype),
    }


def normalized_ess(log_w_B: torch.Tensor, mask_B: torch.Tensor) -> torch.Tensor:
    """``(sum W)^2 / (n sum W^2)`` from log-weights; 1 when all weights are equal, 0 if empty."""
    n = int(mask_B.sum())
    if n == 0:
        return log_w_B.new_zeros(())
    lw = log_w_B[mask_B].double()
    log_ess = 2 * torch.logsumexp(lw, 0) - torch.logsumexp(2 * lw, 0) - math.log(n)
    return log_ess.exp().to(log_w_B.dtype)
