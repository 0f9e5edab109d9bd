"""The old-logprob pass: what the N updates of a rollout need from the weights that start it.

One forward-only pass over every micro-batch of the rollout (merged into as few forwards as the
token budget allows, `train.merged_pass`) gives per micro-batch: the trainer's log-probs
``old_BT``, the behaviour policy's (the trainer's, or the engine's with ``--behavior-logprobs
rollout``), the loss mask (stale tokens out with ``--mask-stale-tokens``; a rollout correction's
mask and token weights), and the reference's log-probs when a KL term needs them. R2 records each
micro-batch's routing here; R3 replays the engine's. With pipeline parallelism the entries exist
on the last stage (None elsewhere).

Metrics: the train/rollout mismatch ``mismatch/train_rollout_logprob_abs_gap`` =
mean |log pi_train - log mu_rollout| and ``mismatch/train_rollout_k3`` = mean(exp(-d) - 1 + d),
d = log pi_train - log mu_rollout clamped to [-20, 20]; the policy's ``entropy``; the per-token
staleness (`train.token_versions`).
"""

from __future__ import annotations

import torch

from megatron_rl.losses import rollout_correction
from megatron_rl.train.batch import MicroBatch
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.logprobs import token_entropy, token_logprobs
from megatron_rl.train.merged_pass import forward_only_pass, forward_token_budget
from megatron_rl.train.rank_topology import RankTopology
from megatron_rl.train.token_versions import fresh_token_mask, token_staleness_metrics


def old_logprob_pass(
    batches: list[list[MicroBatch]],
    metrics: dict[str, float],
    *,
    model,
    reference,
    replay,
    config: TrainConfig,
    weight_version: int,
    ranks: RankTopology,
) -> list[list[dict | None]]:
    """Per mini-batch, per micro-batch: the `behaviour_entry` (None off the last stage)."""
    flat = [mb for minibatch in batches for mb in minibatch]
    keys = [(j, i) for j, minibatch in enumerate(batches) for i in range(len(minibatch))]
    entries: list[dict | None] = [None] * len(flat)
    # every stage holds the token versions, so every stage checks them and reports the same
    # keys, before any collective
    rollout = config.rollout
    metrics.update(
        token_staleness_metrics(
            [mb.token_versions_BT for mb in flat],
            [mb.loss_mask_BT for mb in flat],
            weight_version,
            rollout.max_staleness,
            mask_stale=rollout.mask_stale_tokens,
        )
    )
    # forward-only: the micro-batches run merged, up to this many padded tokens a forward
    merged = dict(
        max_tokens=forward_token_budget(config.schedule.token_budget),
        group=ranks.data_parallel_group,
    )
    gaps: list = [None] * len(flat)  # by index: merged forwards call on_logits out of order
    entropies: list = [None] * len(flat)
    refs: list = [None] * len(flat)
    if reference is not None:
        with reference.resident():
            refs = reference.logprobs(flat, rollout.temperature, **merged)

    def on_logits(k: int, logits: torch.Tensor) -> None:
        mb = flat[k]
        entry = behaviour_entry(mb, logits, refs[k], config, weight_version)
        gaps[k] = (entry["old"] - mb.rollout_logprobs_BT)[mb.loss_mask_BT]
        entropies[k] = token_entropy(logits, rollout.temperature)[mb.loss_mask_BT]
        entries[k] = entry

    model.eval()
    with torch.no_grad():
        forward_only_pass(model, flat, keys, replay, on_logits, **merged)
    model.train()
    if ranks.last_stage:
        gap = torch.cat(gaps).clamp(-20, 20)  # log(pi_train / mu_rollout) per response token
        metrics["mismatch/train_rollout_logprob_abs_gap"] = float(gap.abs().mean())
        metrics["mismatch/train_rollout_k3"] = float((torch.expm1(-gap) + gap).mean())
        metrics["entropy"] = float(torch.cat(entropies).mean())
    out, k = [], 0
    for minibatch in batches:
        out.append(entries[k : k + len(minibatch)])
        k += len(minibatch)
    return out


def behaviour_entry(
    mb: MicroBatch, logits: torch.Tensor, ref_logprobs, config: TrainConfig, weight_version: int
) -> dict:
    """What the updates of one micro-batch need: ``old``, ``behaviour``, ``mask``, ``weights``
    (None without a rollout correction) and ``ref`` (with a reference).

    ``--mask-stale-tokens``: tokens more than ``--max-staleness`` versions behind the trainer's
    version at this pass (``weight_version``, which the rollout's N updates share) leave the loss
    mask before the rollout correction sees it.
    """
    old = token_logprobs(logits, mb.tokens_BS, config.rollout.temperature)
    behaviour = old if config.objective.behavior_logprobs == "trainer" else mb.rollout_logprobs_BT
    mask = mb.loss_mask_BT
    if config.rollout.mask_stale_tokens:
        mask = mask & fresh_token_mask(
            mb.token_versions_BT, weight_version, config.rollout.max_staleness
        )
    entry = {"old": old, "behaviour": behaviour, "mask": mask, "weights": None}
    if config.objective.rollout_correction != "none":
        correction = rollout_correction(
            config.objective.rollout_correction,
            old_logprobs=old,
            rollout_logprobs=mb.rollout_logprobs_BT,
            loss_mask=mask,
        )
        entry.update(weights=correction.weights, mask=correction.loss_mask)
    if ref_logprobs is not None:
        entry["ref"] = ref_logprobs
    return entry
