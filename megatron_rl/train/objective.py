"""The training objective of one micro-batch: policy loss + KL to a frozen reference.

    L = policy_loss(log pi, log mu, A; agg) + kl_coef * agg(KL_estimator(log pi, log pi_ref))

Both terms use the *same* aggregation (``--loss-agg-mode``, or the loss's own default, resolved
once in `ObjectiveConfig`) and the same global denominators (response tokens and sequences of the
whole optimizer step over every data-parallel rank), so summing micro-batch and data-parallel
shard losses reproduces the full-batch objective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rl.losses import (
    AGGREGATION_MODES,
    PolicyLossOutput,
    compute_policy_loss,
    get_loss_spec,
    kl_penalty,
)
from megatron_rl.losses.aggregation import aggregate_padded
from megatron_rl.losses.kl import KL_ESTIMATORS


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    loss: str = "grpo"
    loss_params: tuple[tuple[str, object], ...] = ()  # the loss's own hyperparameters
    loss_agg_mode: str | None = None  # None: the loss's default
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    max_response_length: int | None = None  # Dr.GRPO's constant (seq-mean-token-sum-norm)
    agg_mode: str = field(init=False)  # resolved aggregation, used by both terms

    def __post_init__(self) -> None:
        spec = get_loss_spec(self.loss)  # names the registered losses when unknown
        mode = self.loss_agg_mode or spec.default_agg_mode
        if mode not in AGGREGATION_MODES:
            raise ValueError(f"loss_agg_mode={mode!r}: choose one of {AGGREGATION_MODES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator={self.kl_estimator!r}: choose one of {KL_ESTIMATORS}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef={self.kl_coef}: must be >= 0")
        spec.make_config(dict(self.loss_params))  # the loss's own value checks
        object.__setattr__(self, "agg_mode", mode)


def objective(
    config: ObjectiveConfig,
    *,
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    num_tokens: float,
    num_seqs: float,
    token_weights_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The objective of one micro-batch (``[b, T]`` tensors; ``num_*`` are global counts).

    ``ref_logprobs_BT`` is required exactly when ``config.kl_coef > 0``; the KL value is reported
    as the metric ``kl/value``.
    """
    if (ref_logprobs_BT is None) != (config.kl_coef == 0):
        raise ValueError("ref_logprobs_BT is needed exactly when kl_coef > 0")
    out = compute_policy_loss(
        config.loss,
        logprobs=logprobs_BT,
        old_logprobs=old_logprobs_BT,
        advantages=advantages_B,
        loss_mask=loss_mask_BT,
        loss_agg_mode=config.agg_mode,
        global_num_tokens=num_tokens,
        global_num_seqs=num_seqs,
        max_response_length=config.max_response_length,
        token_weights=token_weights_BT,
        **dict(config.loss_params),
    )
    if ref_logprobs_BT is not None:
        kl_BT = kl_penalty(logprobs_BT, ref_logprobs_BT, loss_mask_BT, config.kl_estimator)
        kl = aggregate_padded(
            kl_BT,
            loss_mask_BT,
            config.agg_mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            max_response_length=config.max_response_length,
        )
        out.loss = out.loss + config.kl_coef * kl
        out.metrics["kl/value"] = kl.detach()
    return out
