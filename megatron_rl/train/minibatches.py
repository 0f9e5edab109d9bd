"""One rank's share of a rollout as the updates consume it: mini-batches of micro-batches.

Mini-batch ``j`` of every data-parallel rank is chunk ``j`` of its ``global_batch_size / dp``
samples, so the ``j``-th optimizer step sees one global set. ``--balance-data`` re-splits each
mini-batch over the ranks by token count (Karmarkar-Karp with equal sample counts, the same
partition on every rank); micro-batches hold ``micro_batch_size`` rows, or as many as a padded
token budget allows (``--max-tokens-per-gpu``, longest samples first; `train.balance`).
"""

from __future__ import annotations

import torch

from megatron_rl.collectives import all_gather_objects
from megatron_rl.train.balance import karmarkar_karp, token_budget_micro_batches
from megatron_rl.train.batch import MicroBatch, TrainSample, make_micro_batch, split
from megatron_rl.train.merged_pass import split_to_count
from megatron_rl.train.pipeline import min_micro_batches
from megatron_rl.train.rank_topology import RankTopology
from megatron_rl.train.schedule import ScheduleConfig


def plan_minibatches(
    samples: list[TrainSample],
    schedule: ScheduleConfig,
    ranks: RankTopology,
    pad_id: int,
    device: torch.device,
    metrics: dict[str, float],
) -> list[list[MicroBatch]]:
    """This rank's mini-batches, each a list of padded micro-batches on ``device``; adds
    ``batch/padding_waste`` (pad tokens per real token), ``batch/micro_batches`` and, when
    balancing, ``batch/dp_token_imbalance[_unbalanced]`` to ``metrics``."""
    minibatches = split(samples, schedule.global_batch_size // ranks.dp)
    if schedule.balance_data and ranks.dp > 1:
        minibatches = balance_minibatches(minibatches, ranks, metrics)
    batches = [
        micro_batches(minibatch, schedule, pad_id, ranks.seq_multiple, device)
        for minibatch in minibatches
    ]
    real = sum(sum(mb.lengths) for row in batches for mb in row)
    padded = sum(mb.tokens_BS.numel() for row in batches for mb in row)
    metrics["batch/padding_waste"] = padded / real - 1.0 if real else 0.0
    metrics["batch/micro_batches"] = float(sum(len(row) for row in batches))
    return batches


def balance_minibatches(
    minibatches: list[list[TrainSample]], ranks: RankTopology, metrics: dict[str, float]
) -> list[list[TrainSample]]:
    """This rank's token-balanced share of every mini-batch (``--balance-data``).

    Mini-batch ``j`` is the union of every rank's chunk ``j``; it is gathered (samples with their
    routing blobs: every rank holds the whole rollout for a moment) and split by token count into
    ``dp`` parts of equal sample counts, the same on every rank (the partition is deterministic);
    rank ``r`` keeps part ``r``, longest samples first.
    """
    gathered = all_gather_objects(minibatches, group=ranks.dp_group)
    if len({len(theirs) for theirs in gathered}) != 1:
        raise RuntimeError(
            f"data-parallel ranks hold different numbers of mini-batches "
            f"{[len(theirs) for theirs in gathered]}; they must pass equal sample counts"
        )
    mine, before, after = [], [], []
    for j in range(len(minibatches)):
        chunks = [theirs[j] for theirs in gathered]
        pool = [sample for chunk in chunks for sample in chunk]
        parts = karmarkar_karp([s.length for s in pool], ranks.dp, equal_size=True)
        share = sorted(parts[ranks.dp_rank], key=lambda i: (-pool[i].length, i))
        mine.append([pool[i] for i in share])
        before.append(imbalance([sum(s.length for s in chunk) for chunk in chunks]))
        after.append(imbalance([sum(pool[i].length for i in part) for part in parts]))
    metrics["batch/dp_token_imbalance_unbalanced"] = sum(before) / len(before)
    metrics["batch/dp_token_imbalance"] = sum(after) / len(after)
    return mine


def micro_batches(
    samples: list[TrainSample],
    schedule: ScheduleConfig,
    pad_id: int,
    seq_multiple: int,
    device: torch.device,
) -> list[MicroBatch]:
    """One mini-batch share as padded micro-batches on ``device``: ``micro_batch_size`` rows
    each, or by token budget (``--max-tokens-per-gpu``; longest samples first; under interleaved
    pipeline parallelism at least PP of them, the largest split in two until there are)."""
    if schedule.token_budget:
        groups = token_budget_micro_batches(
            [s.length for s in samples], schedule.token_budget, seq_multiple
        )
        # the interleaved pipeline schedule needs >= PP micro-batches: split the largest
        groups = split_to_count(groups, min_micro_batches())
        chunks = [[samples[i] for i in group] for group in groups]
    else:
        chunks = split(samples, schedule.micro_batch_size)
    return [make_micro_batch(chunk, pad_id, seq_multiple).to(device) for chunk in chunks]


def imbalance(tokens: list[int]) -> float:
    """Largest share over the mean share (1.0: perfectly balanced)."""
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean else 1.0
