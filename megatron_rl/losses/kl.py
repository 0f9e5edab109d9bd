"""KL estimators between the policy and a frozen reference, per token (Schulman 2020,
"Approximating KL Divergence"). With ``d = log pi_ref - log pi_theta`` on tokens sampled from
``pi_theta``:

* ``k1 = -d``                    unbiased, high variance, can be negative;
* ``k2 = d^2 / 2``               biased, low variance, its gradient is that of the reverse KL;
* ``k3 = e^d - 1 - d``           unbiased and non-negative (GRPO's KL term).

``k3`` uses ``capped_exp`` (exact for ``d <= 20``). Aggregate the result with
``megatron_rl.losses.aggregate_loss`` and the same mode as the policy loss.
"""

from __future__ import annotations

import torch

from megatron_rl.losses.log_space import capped_exp

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    estimator: str = "k3",
) -> torch.Tensor:
    """Per-token KL estimate, same shape as ``logprobs``, zero outside ``loss_mask``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is unknown; choose one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must have the same shape"
        )
    mask = loss_mask.bool()
    zero = logprobs.new_zeros(())
    d = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype), zero) - torch.where(
        mask, logprobs, zero
    )
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = capped_exp(d) - 1 - d
    return torch.where(mask, kl, zero)
