"""TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE: Stable and efficient reinforcement
learning for LLMs", arXiv 2503.14286).

Sequence-level truncated importance sampling applied only to negative samples:

    l_it = -w_i * A_i * log pi_theta(y_it),   w_i = 1 if A_i >= 0 else sg[clamp(W_i, 0, 1)],

with ``W_i = exp(sum_t (log pi_theta - log mu))`` evaluated as ``exp(min(log W_i, 0))``. The
paper's objective uses the sequence log-likelihood ``log pi(y_i) = sum_t log pi_t`` averaged over
trajectories, hence the default ``seq-mean-token-sum``; the VESPO paper's comparison runs it with
length normalisation, which is ``loss_agg_mode="seq-mean-token-mean"``. No hyperparameters.
``clipped_BT`` marks every token of a truncated sequence (``A_i < 0`` and ``W_i > 1``); its metric
``clip_frac_high`` counts those sequences, as a fraction of the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.losses.layout import PaddedInputs
from megatron_rl.losses.log_space import masked_mean
from megatron_rl.losses.registry import LossTerms, register_policy_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class TOPRConfig:
    pass


@register_policy_loss(
    "topr", config=TOPRConfig, default_agg_mode="seq-mean-token-sum", sequence_advantages=True
)
def topr_loss(inputs: PaddedInputs, config: TOPRConfig) -> LossTerms:
    lp_BT = inputs.logprobs_BT
    seq_mask_B = inputs.mask_BT.any(dim=-1)
    with torch.no_grad():
        log_w_B = (lp_BT - inputs.old_logprobs_BT).sum(dim=-1)
        adv_B = inputs.sequence_advantages_B()
        negative_B = adv_B < 0
        weight_B = torch.where(negative_B, torch.exp(log_w_B.clamp(max=0.0)), 1.0)
        metrics = {
            "neg_weight_mean": masked_mean(weight_B, seq_mask_B & negative_B),
            "clip_frac_high": masked_mean((negative_B & (log_w_B > 0)).to(lp_BT.dtype), seq_mask_B),
        }
        truncated_B = negative_B & (log_w_B > 0)
    loss_BT = -(weight_B * adv_B)[:, None] * lp_BT
    return LossTerms(loss_BT, metrics, truncated_B[:, None] & inputs.mask_BT)
