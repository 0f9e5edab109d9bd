"""``compute_policy_loss``: the one entry point through which trainers and users call a loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.losses.aggregation import aggregate_padded, check_agg_mode
from megatron_rl.losses.clip_positions import check_clipped_map, clip_position_metrics
from megatron_rl.losses.layout import PaddedInputs, prepare_inputs
from megatron_rl.losses.metrics import importance_metrics
from megatron_rl.losses.registry import get_loss_spec


@dataclass(slots=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, differentiable w.r.t. logprobs
    per_token_loss: torch.Tensor  # same layout as logprobs, zero where loss_mask is 0
    metrics: dict[str, torch.Tensor]  # namespaced ("policy/...", "<loss name>/..."), detached


def compute_policy_loss(
    name: str,
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    global_num_tokens: float | int | None = None,
    global_num_seqs: float | int | None = None,
    max_response_length: int | None = None,
    token_weights: torch.Tensor | None = None,
    check_finite: bool = True,
    loss_config: Any = None,
    **hyperparameters: Any,
) -> PolicyLossOutput:
    """Compute the registered policy loss ``name``.

    Args:
        logprobs: ``[B, T]`` (or packed ``[N]`` with ``cu_seqlens``) log pi_theta of the taken
            tokens; float32/bf16 are computed in float32, float64 in float64; float16 is
            refused (its range cannot hold the capped ratios).
        old_logprobs: same shape, behaviour-policy log-probs (treated as detached).
        advantages: ``[B]`` (packed: ``[S]``) one per sequence, or one per token (same shape as
            ``logprobs``). Sequence-level losses (gspo, vespo, topr) need one per sequence.
        loss_mask: same shape as ``logprobs``, bool or {0, 1}. Values outside it are ignored,
            even NaN/inf.
        loss_agg_mode: one of ``AGGREGATION_MODES``; ``None`` = the loss's default.
        cu_seqlens: ``[S + 1]`` boundaries of the packed layout; ``None`` for padded inputs.
        global_num_tokens, global_num_seqs: denominators over the whole optimizer batch so that
            summing micro-batch / data-parallel shard losses reproduces the full batch.
        max_response_length: Dr.GRPO's constant for ``seq-mean-token-sum-norm``.
        token_weights: optional detached per-token multipliers of the per-token loss, e.g. the
            rollout-correction weights of ``megatron_rl.losses.rollout_correction``.
        check_finite: raise ``ValueError`` on NaN/inf inside the mask (costs one device sync).
        loss_config: the loss's own config, already built and checked (``spec.make_config``,
            e.g. once per run by the trainer); instead of ``hyperparameters``.
        **hyperparameters: the loss's own (see ``available_losses()`` and each config class).

    Returns:
        ``PolicyLossOutput(loss, per_token_loss, metrics)``. A loss that clips also gets the
        position-wise clipping metrics ``policy/clip_pos_tokens_{k}``,
        ``policy/clip_pos_clipped_{k}``, ``policy/clip_frac_pos_{k}`` and
        ``policy/clip_position_cv`` (``megatron_rl.losses.clip_positions``).
    """
    spec = get_loss_spec(name)
    if loss_config is not None and hyperparameters:
        raise ValueError("pass the loss's hyperparameters or its built loss_config, not both")
    config = spec.make_config(hyperparameters) if loss_config is None else loss_config
    mode = spec.default_agg_mode if loss_agg_mode is None else loss_agg_mode
    check_agg_mode(mode)

    inputs, layout = prepare_inputs(
        logprobs, old_logprobs, advantages, loss_mask, cu_seqlens, check_finite
    )
    if spec.sequence_advantages and not inputs.per_sequence_advantages:
        _require_constant_per_sequence(name, inputs)

    terms = spec.fn(inputs, config)
    per_token_BT = terms.per_token_loss_BT
    if token_weights is not None:
        per_token_BT = per_token_BT * _padded_weights(token_weights, logprobs, inputs, layout)
    per_token_BT = torch.where(inputs.mask_BT, per_token_BT, per_token_BT.new_zeros(()))
    if check_finite and not bool(torch.isfinite(per_token_BT.detach()).all()):
        raise ValueError(
            f"loss {name!r} produced a non-finite per-token loss from finite inputs; check "
            "token_weights and the hyperparameters"
        )
    loss = aggregate_padded(
        per_token_BT,
        inputs.mask_BT,
        mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_length=max_response_length,
    )

    metrics = {f"policy/{k}": v for k, v in importance_metrics(inputs).items()}
    metrics.update({f"{name}/{k}": v.detach() for k, v in terms.metrics.items()})
    if terms.clipped_BT is not None:  # where in the responses the clip acted (clip_positions.py)
        check_clipped_map(terms.clipped_BT, inputs.mask_BT, f"loss {name!r}")
        positions = clip_position_metrics(terms.clipped_BT.detach(), inputs.mask_BT)
        metrics.update({f"policy/{k}": v for k, v in positions.items()})
    metrics["policy/loss"] = loss.detach()
    per_token = per_token_BT if layout is None else layout.to_packed(per_token_BT)
    return PolicyLossOutput(loss, per_token.to(logprobs.dtype), metrics)


def _require_constant_per_sequence(name: str, inputs: PaddedInputs) -> None:
    adv_BT, mask_BT = inputs.advantages_BT, inputs.mask_BT
    big = adv_BT.new_tensor(float("inf"))
    seq_max = torch.where(mask_BT, adv_BT, -big).amax(dim=-1)
    seq_min = torch.where(mask_BT, adv_BT, big).amin(dim=-1)
    varies = mask_BT.any(dim=-1) & (seq_max != seq_min)
    if bool(varies.any()):
        raise ValueError(
            f"loss {name!r} is sequence-level and needs one advantage per sequence, but "
            f"advantages vary within sequence {int(varies.nonzero()[0])}; pass advantages as "
            "[B] (or [S] packed), or use 'gspo_token' for per-token advantages"
        )


def _padded_weights(weights, logprobs, inputs: PaddedInputs, layout) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != tuple(logprobs.shape):
        shape = getattr(weights, "shape", None)
        raise ValueError(
            f"token_weights has shape {tuple(shape) if shape is not None else shape}, expected "
            f"{tuple(logprobs.shape)} (same as logprobs)"
        )
    weights = weights.detach().to(inputs.logprobs_BT.dtype)
    weights_BT = weights if layout is None else layout.to_padded(weights)
    bad = inputs.mask_BT & ~torch.isfinite(weights_BT)
    if bool(bad.any()):
        raise ValueError("token_weights has non-finite values inside loss_mask")
    return torch.where(inputs.mask_BT, weights_BT, weights_BT.new_zeros(()))
