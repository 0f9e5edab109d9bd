"""Over-sampling with dynamic-sampling refill: every trained batch is full of groups with signal.

DAPO's dynamic sampling (Yu et al. 2025, "DAPO", Sec. 3.2) keeps drawing prompts until the batch
holds ``rollout_batch_size`` groups whose rewards are not all equal (a group with zero reward
variance has advantage 0 everywhere and teaches nothing); slime draws an over-sampled batch
(``--over-sampling-batch-size``) for the same reason, and verl regenerates up to
``max_num_gen_batches`` times. Here (``--dynamic-sampling``), for a batch of ``B`` groups:

1. round 0 draws ``D0 = ceil((1 + ratio) B)`` prompts (``--over-sampling-ratio``; rounded up to a
   multiple of the data-parallel size, each rank generating its share);
2. a group is kept when it carries a learning signal (a sample in the loss with a non-zero
   advantage: its scored rewards are not all equal) and, with ``--drop-overlong-groups``, none
   of its responses hit ``--max-response-length``;
3. while fewer than ``B`` groups are kept and ``--dynamic-sampling-max-rounds`` extra rounds are
   not spent, another round draws ``ceil(deficit (1 + ratio) / keep rate)`` prompts (the keep
   rate so far, taken as at least 1/8) from the same sampler;
4. the batch is the first ``B`` kept groups in draw order (round, rank, position); kept groups
   beyond ``B`` are discarded, as in DAPO. When the rounds are spent with fewer than ``B`` kept,
   the batch is completed with dropped groups in draw order, masked out of the loss
   (``in_loss=False``): the run trains on what there is, with the batch's shape (and the number
   of optimizer steps) unchanged, and says so in ``dynamic_sampling/short_groups``;
5. data-parallel rank ``r`` trains on groups ``[r B / dp, (r + 1) B / dp)`` of the batch: every
   rank ends with the same number of groups (the selected groups are exchanged over the
   data-parallel group).

Prompts come from the run's one sampler, so no prompt is drawn twice within an epoch (a discarded
group's prompt is not drawn again before the next epoch); a checkpoint records the sampler after
every round. The refill rounds run in the trainer's thread after the rollout is taken; with
``--async-rollout`` round 0 was generated ahead (one version behind) and the refill rounds use the
current weights (each sample carries its ``weight_version``).

Metrics (global: the same on every rank): ``dynamic_sampling/groups_drawn``, ``groups_kept``,
``groups_dropped_zero_variance``, ``groups_dropped_overlong``, ``rounds``, ``short_groups``.
The rollout metrics (``reward/mean``, ``accuracy``, ...) cover every generated sample of every
round, i.e. the policy's accuracy on the prompts drawn, not on the filtered batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from megatron_rl.collectives import all_gather_objects
from megatron_rl.train.batch import TrainSample
from megatron_rl.train.rollouts.source import Generated, RolloutBatch

MIN_KEEP_RATE = 1 / 8  # a refill round never draws more than 8 (1 + ratio) x the deficit


def group_has_signal(group: Sequence[TrainSample]) -> bool:
    """A sample of the group is in the loss with a non-zero advantage (its rewards differ)."""
    return any(s.in_loss and s.advantage != 0 for s in group)


def group_overlong(group: Sequence[TrainSample]) -> bool:
    """A response of the group was cut at the length limit."""
    return any(s.truncated for s in group)


def first_draw(batch_groups: int, ratio: float, dp: int) -> int:
    """``D0 = ceil((1 + ratio) B)`` rounded up to a multiple of ``dp``."""
    wanted = math.ceil((1 + ratio) * batch_groups - 1e-9)
    return -(-wanted // dp) * dp


def refill_draw(deficit: int, ratio: float, keep_rate: float, dp: int) -> int:
    """Prompts for a refill round: ``ceil(deficit (1 + ratio) / max(keep_rate, 1/8))`` rounded up
    to a multiple of ``dp``."""
    wanted = math.ceil(deficit * (1 + ratio) / max(keep_rate, MIN_KEEP_RATE) - 1e-9)
    return -(-max(wanted, 1) // dp) * dp


def merge_rollout_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Rollout metrics of several rounds as one: sample-weighted means, except maxima (``*/max``),
    the oldest weight version (``rollout/weight_version``) and counts (``rollout/aborted``)."""
    if len(parts) == 1:
        return dict(parts[0][0])
    total = sum(n for _, n in parts)
    merged: dict[str, float] = {}
    for key in parts[0][0]:
        values = [(m[key], n) for m, n in parts if key in m]
        if key.endswith("/max"):
            merged[key] = max(v for v, _ in values)
        elif key == "rollout/weight_version":
            merged[key] = min(v for v, _ in values)
        elif key == "rollout/aborted":
            merged[key] = sum(v for v, _ in values)
        else:
            merged[key] = sum(v * n for v, n in values) / total if total else 0.0
    return merged


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DynamicSampling:
    """Refills a rollout to ``batch_groups`` groups with signal (see the module docstring).

    ``draw(count)``: this rank's share of the next ``count`` prompts of the sampler (every rank
    calls it with the same count). ``generate(prompts, round)``: this replica's
    ``(samples, metrics)`` for ``prompts`` on every model-parallel rank (the generator generates,
    the others receive). ``dp_group``: None when there is one data-parallel rank.
    """

    batch_groups: int  # B: groups per rollout
    group_size: int  # samples per prompt
    ratio: float
    max_rounds: int  # extra rounds after the first
    drop_overlong: bool
    dp: int
    dp_rank: int
    dp_group: object
    draw: Callable[[int], list[int]]
    generate: Callable[[list[int], int], Generated]

    @property
    def first_draw(self) -> int:
        return first_draw(self.batch_groups, self.ratio, self.dp)

    def fill(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` (round 0, ``first_draw / dp`` groups on this rank) refilled and trimmed to
        ``batch_groups / dp`` groups on this rank."""
        rounds = [(batch.prompts, batch.samples)]
        metrics = [(batch.metrics, len(batch.samples))]
        counts = self._gather_flags(rounds[-1][1], 0, [])
        kept = sum(1 for c in counts if c[3])
        drawn = self.first_draw
        while kept < self.batch_groups and len(rounds) <= self.max_rounds:
            deficit = self.batch_groups - kept
            count = refill_draw(deficit, self.ratio, kept / drawn, self.dp)
            prompts = self.draw(count)
            samples, round_metrics = self.generate(prompts, len(rounds))
            rounds.append((prompts, samples))
            metrics.append((round_metrics, len(samples)))
            counts = self._gather_flags(samples, len(rounds) - 1, counts)
            kept = sum(1 for c in counts if c[3])
            drawn += count
        selected = [c for c in counts if c[3]][: self.batch_groups]
        short = self.batch_groups - len(selected)
        if short:  # complete with dropped groups, masked out of the loss
            selected += [c for c in counts if not c[3]][:short]
        selected.sort(key=lambda c: c[:3])
        mine = self._exchange(rounds, selected)
        merged = merge_rollout_metrics(metrics)
        merged.update(
            {
                "dynamic_sampling/groups_drawn": float(drawn),
                "dynamic_sampling/groups_kept": float(kept),
                "dynamic_sampling/groups_dropped_zero_variance": float(
                    sum(1 for c in counts if not c[4])
                ),
                "dynamic_sampling/groups_dropped_overlong": float(
                    sum(1 for c in counts if c[4] and not c[3])
                ),
                "dynamic_sampling/rounds": float(len(rounds)),
                "dynamic_sampling/short_groups": float(short),
            }
        )
        samples = [s for _, group in mine for s in group]
        return dataclasses.replace(
            batch, samples=samples, metrics=merged, prompts=[p for p, _ in mine]
        )

    def _gather_flags(self, samples: list[TrainSample], round_index: int, counts: list) -> list:
        """``counts`` plus this round's ``(round, rank, position, keep, signal)`` of every group
        of every rank, in draw order."""
        n = self.group_size
        mine = []
        for position in range(len(samples) // n):
            group = samples[position * n : (position + 1) * n]
            signal = group_has_signal(group)
            keep = signal and not (self.drop_overlong and group_overlong(group))
            mine.append((round_index, self.dp_rank, position, keep, signal))
        everyone = [mine] if self.dp == 1 else all_gather_objects(mine, group=self.dp_group)
        return counts + [flags for rank_flags in everyone for flags in rank_flags]

    def _exchange(self, rounds, selected: list) -> list[tuple[int, list[TrainSample]]]:
        """This rank's ``(prompt, group)`` share of the ``selected`` groups (sorted in draw
        order); a group masked in only to complete the batch leaves the loss."""
        n = self.group_size
        held = []
        for order, (round_index, rank, position, keep, _) in enumerate(selected):
            if rank != self.dp_rank:
                continue
            prompts, samples = rounds[round_index]
            group = samples[position * n : (position + 1) * n]
            if not keep:
                group = [dataclasses.replace(s, in_loss=False) for s in group]
            held.append((order, prompts[position], group))
        if self.dp > 1:
            held = [g for theirs in all_gather_objects(held, group=self.dp_group) for g in theirs]
        held.sort(key=lambda g: g[0])
        per_rank = self.batch_groups // self.dp
        share = held[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [(prompt, group) for _, prompt, group in share]
