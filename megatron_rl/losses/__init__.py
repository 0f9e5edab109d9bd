"""Policy losses for RL post-training: pure torch, no Megatron.

>>> from megatron_rl.losses import compute_policy_loss, available_losses
>>> out = compute_policy_loss("vespo", logprobs=lp, old_logprobs=olp, advantages=adv,
...                           loss_mask=mask)                                   # doctest: +SKIP

Importing this package registers grpo, dapo, gspo, gspo_token, vespo, epic, sapo, cispo, topr,
ctpo, ripo.
"""

from megatron_rl.losses import (  # noqa: F401
    cispo,
    ctpo,
    epic,
    gspo,
    ppo_clip,
    ripo,
    sapo,
    topr,
    vespo,
)
from megatron_rl.losses.aggregation import AGGREGATION_MODES
from megatron_rl.losses.kl import KL_ESTIMATORS, kl_penalty
from megatron_rl.losses.policy_loss import PolicyLossOutput, compute_policy_loss
from megatron_rl.losses.registry import (
    LossTerms,
    available_losses,
    get_loss_spec,
    register_policy_loss,
)
from megatron_rl.losses.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    RolloutCorrection,
    rollout_correction,
)

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "LossTerms",
    "PolicyLossOutput",
    "RolloutCorrection",
    "available_losses",
    "compute_policy_loss",
    "get_loss_spec",
    "kl_penalty",
    "register_policy_loss",
    "rollout_correction",
]
