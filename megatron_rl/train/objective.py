"""The training objective of one micro-batch: policy loss + KL to a frozen reference.

    L = policy_loss(log pi, log mu, A; agg) + kl_coef * agg(KL_estimator(log pi, log pi_ref))

Both terms use the *same* aggregation (``--loss-agg-mode``, or the loss's own default, resolved
once in `ObjectiveConfig`) and the same global denominators (response tokens and sequences of the
whole optimizer step over every data-parallel rank), so summing micro-batch and data-parallel
shard losses reproduces the full-batch objective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from megatron_rl.flags import bad_value, check_choice, derived, option
from megatron_rl.losses import (
    AGGREGATION_MODES,
    ROLLOUT_CORRECTIONS,
    PolicyLossOutput,
    available_losses,
    compute_policy_loss,
    get_loss_spec,
    kl_penalty,
)
from megatron_rl.losses.aggregation import aggregate_padded
from megatron_rl.losses.kl import KL_ESTIMATORS
from megatron_rl.losses.opsm import check_delta, opsm_keep
from megatron_rl.losses.rollout_correction import DECOUPLED_CORRECTIONS

BEHAVIOUR_LOGPROBS = ("trainer", "rollout")
FIRST_UPDATE_OLD_LOGPROBS = ("update", "pass")


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    """The RL objective: policy loss, KL to the reference, rollout correction."""

    loss: str = option("grpo", choices=available_losses(), help="the policy loss")
    # the loss's own hyperparameters: one flag each (--clip-high, --delta-low, ...; see config.py)
    loss_params: tuple[tuple[str, object], ...] = ()
    loss_agg_mode: str | None = option(
        None, choices=(None, *AGGREGATION_MODES), help="aggregation; default: the loss's own"
    )
    kl_coef: float = option(0.0, help="weight of the KL penalty to the initial policy (0: off)")
    kl_estimator: str = option("k3", choices=KL_ESTIMATORS, help="KL estimator (k1, k2, k3, ...)")
    reference_offload: bool = option(
        True,
        name="no-reference-offload",
        help="keep the KL reference model on the GPU (default: host memory between uses)",
    )
    rollout_correction: str = option(
        "none",
        choices=("none", *ROLLOUT_CORRECTIONS),
        help="reweight / mask tokens by the trainer/rollout probability ratio",
    )
    m2po_tau: float = option(
        0.04,
        help="--rollout-correction m2po: the bound on the mean second moment (log mu - log "
        "pi_old)^2 of the tokens kept (AReaL's m2_threshold; 0.04 as its M2PO example)",
    )
    opsm_delta: float | None = option(
        None,
        help="off-policy sequence masking (DeepSeek-V3.2; slime --use-opsm): a sequence with a "
        "negative advantage whose mean log pi_behaviour - log pi_current over its response "
        "exceeds this leaves the policy loss at that update (slime's default 1e-4; "
        "megatron_rl/losses/opsm.py); off by default",
    )
    behavior_logprobs: str = option(
        "trainer",
        choices=BEHAVIOUR_LOGPROBS,
        help="the loss's old log-probs: the trainer's recomputation or the rollout engine's",
    )
    first_update_old_logprobs: str = option(
        "update",
        choices=FIRST_UPDATE_OLD_LOGPROBS,
        help="the trainer's old log-probs of the first update's samples: that update's own "
        "forward, detached (the weights have not moved yet: the ratio is exactly 1, as in verl's "
        "on-policy update; their share of the old-logprob pass is skipped), or the old-logprob "
        "pass; the pass is used anyway with R2, --rollout-correction mis-*/icepop, dropout or "
        "router jitter (megatron_rl/train/old_logprob.py)",
    )
    max_response_length: int | None = derived(None, source="rollout.max_response_length")
    agg_mode: str = field(init=False)  # resolved aggregation, used by both terms
    loss_config: object = field(init=False)  # the loss's own config, built and checked once

    def __post_init__(self) -> None:
        check_choice(self, "loss", available_losses())
        spec = get_loss_spec(self.loss)
        mode = self.loss_agg_mode or spec.default_agg_mode
        if mode not in AGGREGATION_MODES:
            raise bad_value(self, "loss_agg_mode", f"choose one of {AGGREGATION_MODES}")
        check_choice(self, "kl_estimator", KL_ESTIMATORS)
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise bad_value(self, "kl_coef", "must be a finite number >= 0")
        check_choice(self, "rollout_correction", ("none", *ROLLOUT_CORRECTIONS))
        check_choice(self, "behavior_logprobs", BEHAVIOUR_LOGPROBS)
        if self.rollout_correction in DECOUPLED_CORRECTIONS and self.behavior_logprobs != "trainer":
            raise bad_value(
                self,
                "rollout_correction",
                f"{self.rollout_correction} clips against the trainer's recompute and weights by "
                "pi_old / mu: it needs --behavior-logprobs trainer",
            )
        if not (math.isfinite(self.m2po_tau) and self.m2po_tau > 0):
            raise bad_value(self, "m2po_tau", "must be a finite number > 0")
        if self.opsm_delta is not None:
            check_delta(self.opsm_delta)
        check_choice(self, "first_update_old_logprobs", FIRST_UPDATE_OLD_LOGPROBS)
        known = [f.name for f in fields(spec.config_cls)]
        for name, _ in self.loss_params:
            if name not in known:
                theirs = ", ".join(f"--{k.replace('_', '-')}" for k in known) or "none"
                raise ValueError(
                    f"--{name.replace('_', '-')} is not a hyperparameter of --loss {self.loss} "
                    f"(its hyperparameters: {theirs}); drop the flag or choose the loss that has it"
                )
        object.__setattr__(self, "agg_mode", mode)
        object.__setattr__(self, "loss_config", spec.make_config(dict(self.loss_params)))


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
    opsm_metrics = {}
    if config.opsm_delta is not None:  # at this update's policy: a mask of 0/1 loss weights
        keep_BT, opsm_metrics = opsm_keep(
            logprobs_BT.detach(), old_logprobs_BT, advantages_B, loss_mask_BT, config.opsm_delta
        )
        token_weights_BT = keep_BT if token_weights_BT is None else token_weights_BT * keep_BT
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
        loss_config=config.loss_config,
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
    out.metrics.update(opsm_metrics)
    return out
