"""The old-logprob pass: what the N updates of a rollout need from the weights that start it.

One forward-only pass over every micro-batch of the rollout (merged into as few forwards as the
token budget allows, `train.merged_pass`) gives per micro-batch: the trainer's log-probs
``old_BT``, the behaviour policy's (the trainer's, or the engine's with ``--behavior-logprobs
rollout``), the loss mask (stale tokens out with ``--mask-stale-tokens``; a rollout correction's
mask and token weights), and the reference's log-probs when a KL term needs them. R2 records each
micro-batch's routing here; R3 replays the engine's. With pipeline parallelism the entries exist
on the last stage (None elsewhere).

The first update folds its share of the pass into its own forward (``--first-update-old-logprobs
update``, the default): its weights are still the ones that start the rollout, so its log-probs,
detached, are the old log-probs (verl's on-policy rule, ``old = log pi.detach()``: the ratio is
exactly 1 there; a separate pass differs from it by float rounding, ~1e-7). With one update per
rollout (N = 1) no forward-only pass runs at all. `fold_blocker` names what keeps the whole pass:
R2 or R3 (they record or compare routes in the pass), a rollout correction that masks tokens by
the ratio (the update's token count must be known before its forward), dropout or router jitter
(the update's forward is then not the pass's).

Metrics: the train/rollout mismatch ``mismatch/train_rollout_logprob_abs_gap`` =
mean |log pi_train - log mu_rollout| and ``mismatch/train_rollout_k3`` = mean(exp(-d) - 1 + d),
d = log pi_train - log mu_rollout clamped to [-20, 20], and the gap by response position
(``mismatch/train_rollout_logprob_abs_gap/pos_<a>_<b>``, positions a..b of the response counted
from 0, buckets `GAP_POSITION_BUCKETS`); the policy's ``entropy``; the per-token staleness
(`train.token_versions`). Folded micro-batches join them when their update runs
(`OldLogprobs.finish` writes them after the updates).
"""

from __future__ import annotations

import torch

from megatron_rl.collectives import sum_over_ranks
from megatron_rl.losses import rollout_correction
from megatron_rl.train.batch import MicroBatch
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.logprobs import token_entropy
from megatron_rl.train.merged_pass import forward_only_pass, forward_token_budget
from megatron_rl.train.rank_topology import RankTopology
from megatron_rl.train.support_logprobs import policy_logprobs
from megatron_rl.train.token_versions import fresh_token_mask, token_staleness_metrics

# response-position buckets [start, end) of the train/rollout gap (the last one open-ended)
GAP_POSITION_BUCKETS = ((0, 16), (16, 32), (32, 64), (64, 128), (128, None))

# rollout corrections whose loss mask does not depend on the ratio (token weights only)
_WEIGHTING_CORRECTIONS = ("none", "tis-token", "tis-seq", "decoupled")  # the mask unchanged


def fold_blocker(config: TrainConfig, model_config) -> str | None:
    """Why the first update cannot take its old log-probs from its own forward, or None.

    ``model_config``: megatron's ``TransformerConfig`` of the policy (dropout, router jitter).
    """
    if config.objective.first_update_old_logprobs == "pass":
        return "--first-update-old-logprobs pass"
    if config.replay.mode != "off":
        return f"--routing-replay {config.replay.mode} records or compares routes in the pass"
    if config.objective.rollout_correction not in _WEIGHTING_CORRECTIONS:
        return (
            f"--rollout-correction {config.objective.rollout_correction} masks tokens by the "
            "ratio, and an update's token count is needed before its forward"
        )
    for name in ("hidden_dropout", "attention_dropout", "moe_input_jitter_eps"):
        if getattr(model_config, name, None):
            return f"the model's {name} makes the update's forward differ from the pass's"
    return None


class OldLogprobs:
    """The pass's result: `entries` per mini-batch, per micro-batch (None off the last stage).

    An entry is `behaviour_entry`'s dict; a folded one holds ``old = None`` with its ``mask``
    (and ``ref``) until its update's forward calls `complete`.
    """

    def __init__(self, entries: list[list[dict | None]], config: TrainConfig, weight_version: int):
        self.entries = entries
        self.config = config
        self.weight_version = weight_version
        # by (mini-batch, micro-batch): log pi_train - log mu_rollout and the entropy, over
        # response tokens
        self.gaps: dict[tuple[int, int], torch.Tensor] = {}
        self.positions: dict[tuple[int, int], torch.Tensor] = {}  # response position per token
        self.entropies: dict[tuple[int, int], torch.Tensor] = {}

    def record(self, key: tuple[int, int], mb: MicroBatch, entry: dict, logits) -> None:
        """Add micro-batch ``key`` to the mismatch and entropy metrics."""
        with torch.no_grad():
            self.gaps[key] = (entry["old"] - mb.rollout_logprobs_BT)[mb.loss_mask_BT]
            self.positions[key] = (mb.loss_mask_BT.long().cumsum(dim=-1) - 1)[mb.loss_mask_BT]
            entropy = token_entropy(logits.detach(), self.config.rollout.temperature)
            self.entropies[key] = entropy[mb.loss_mask_BT]

    def complete(self, j: int, i: int, mb: MicroBatch, logits, logprobs) -> dict:
        """Entry ``(j, i)`` from its update's forward (``logits``, ``logprobs``: that
        micro-batch's, with the pass's weights); returns it (already complete: unchanged)."""
        entry = self.entries[j][i]
        if entry["old"] is not None:
            return entry
        done = behaviour_entry(
            mb, logprobs.detach(), entry.get("ref"), self.config, self.weight_version
        )
        if not torch.equal(done["mask"], entry["mask"]):  # fold_blocker keeps this from happening
            raise RuntimeError(f"micro-batch {(j, i)}: the folded loss mask changed in its update")
        entry.update(done)
        self.record((j, i), mb, entry, logits)
        return entry

    def finish(self, metrics: dict[str, float], *, group=None) -> None:
        """The mismatch and entropy metrics over every micro-batch that has its old log-probs
        (on the last stage; a folded update that never ran leaves its micro-batches out).

        Every last-stage rank must call it (``group``: its data-parallel group): the gap by
        response position is summed over the group, token-weighted, so that every rank reports
        the same buckets (a bucket empty on one rank would otherwise give the ranks different
        metric keys)."""
        order = sorted(self.gaps)  # micro-batch order, whichever ran first
        gap = torch.cat([self.gaps[k] for k in order]).clamp(-20, 20) if order else None
        positions = torch.cat([self.positions[k] for k in order]) if order else None
        totals = []
        for start, end in GAP_POSITION_BUCKETS:
            if gap is None:
                totals += [0.0, 0.0]
                continue
            inside = positions >= start if end is None else (positions >= start) & (positions < end)
            totals += [float(gap[inside].abs().sum()), float(inside.sum())]
        totals = sum_over_ranks(totals, group=group)
        for b, (start, end) in enumerate(GAP_POSITION_BUCKETS):
            total, count = totals[2 * b], totals[2 * b + 1]
            if count > 0:
                name = f"pos_{start}_{'' if end is None else end - 1}".rstrip("_")
                metrics[f"mismatch/train_rollout_logprob_abs_gap/{name}"] = total / count
        if gap is None:
            return
        # log(pi_train / mu_rollout) per response token
        metrics["mismatch/train_rollout_logprob_abs_gap"] = float(gap.abs().mean())
        metrics["mismatch/train_rollout_k3"] = float((torch.expm1(-gap) + gap).mean())
        metrics["entropy"] = float(torch.cat([self.entropies[key] for key in order]).mean())


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
    fold_first: bool = False,
) -> OldLogprobs:
    """The old log-probs of every micro-batch of ``batches`` (per mini-batch); ``fold_first``
    (`fold_blocker` is None): mini-batch 0's are left to its update (`OldLogprobs.complete`)."""
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
    refs: list = [None] * len(flat)
    if reference is not None:
        with reference.resident():
            refs = reference.logprobs(flat, rollout.temperature, **merged)
    folded = len(batches[0]) if fold_first and batches else 0
    if ranks.last_stage:
        for k in range(folded):
            mask = entry_mask(flat[k], config, weight_version)
            entries[k] = {"old": None, "behaviour": None, "mask": mask, "weights": None}
            if refs[k] is not None:
                entries[k]["ref"] = refs[k]
    result = OldLogprobs([], config, weight_version)
    passed = list(range(folded, len(flat)))

    def on_logits(n: int, logits: torch.Tensor) -> None:  # merged forwards: any order
        k = passed[n]
        mb = flat[k]
        old = policy_logprobs(logits, mb, rollout.temperature)
        entries[k] = behaviour_entry(mb, old, refs[k], config, weight_version)
        result.record(keys[k], mb, entries[k], logits)

    if passed:
        model.eval()
        with torch.no_grad():
            forward_only_pass(
                model, [flat[k] for k in passed], [keys[k] for k in passed], replay, on_logits,
                **merged,
            )  # fmt: skip
        model.train()
    k = 0
    for minibatch in batches:
        result.entries.append(entries[k : k + len(minibatch)])
        k += len(minibatch)
    return result


def entry_mask(mb: MicroBatch, config: TrainConfig, weight_version: int) -> torch.Tensor:
    """bool [B, T]: the loss mask before a rollout correction; ``--mask-stale-tokens``: tokens
    more than ``--max-staleness`` versions behind ``weight_version`` (the trainer's version at
    this pass, which the rollout's N updates share) leave it."""
    mask = mb.loss_mask_BT
    if config.rollout.mask_stale_tokens:
        mask = mask & fresh_token_mask(
            mb.token_versions_BT, weight_version, config.rollout.max_staleness
        )
    return mask


def behaviour_entry(
    mb: MicroBatch, old: torch.Tensor, ref_logprobs, config: TrainConfig, weight_version: int
) -> dict:
    """What the updates of one micro-batch need: ``old``, ``behaviour``, ``mask``, ``weights``
    and ``correction_metrics`` (with a rollout correction: ``rollout_correction/...``) and
    ``ref`` (with a reference), from the trainer's old log-probs ``old`` [B, T]."""
    behaviour = old if config.objective.behavior_logprobs == "trainer" else mb.rollout_logprobs_BT
    mask = entry_mask(mb, config, weight_version)
    entry = {"old": old, "behaviour": behaviour, "mask": mask, "weights": None}
    if config.objective.rollout_correction != "none":
        correction = rollout_correction(
            config.objective.rollout_correction,
            old_logprobs=old,
            rollout_logprobs=mb.rollout_logprobs_BT,
            loss_mask=mask,
            tau=config.objective.m2po_tau,
        )
        entry.update(
            weights=correction.weights,
            mask=correction.loss_mask,
            correction_metrics=correction.metrics,  # reported with the update's loss metrics
        )
    if ref_logprobs is not None:
        entry["ref"] = ref_logprobs
    return entry
