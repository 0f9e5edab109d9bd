"""The pipeline schedule of one training pass, as megatron-core 0.16.1 runs it: which (model
chunk, micro-batch) pairs a pipeline rank holds activations of at each step (1F1B, or the
interleaved 1F1B of a virtual pipeline), and the pipeline bubble.

Read from ``megatron/core/pipeline_parallel/schedules.py``:

* ``get_pp_rank_microbatches``: ``V M`` forwards per rank (``V`` model chunks, ``M``
  micro-batches), of which the warm-up runs
  ``W = PP - r - 1`` (plain 1F1B, ``forward_backward_pipelining_without_interleaving``) or
  ``W = 2 (PP - r - 1) + (V - 1) N`` (interleaved, ``N`` = ``microbatch_group_size_per_vp_stage``)
  before the first backward, capped at ``V M`` (then every forward is in the warm-up);
* the steady state: step ``k`` runs forward ``W + k``, then backward ``k``; the cool-down the
  remaining backwards. So a rank holds at most ``min(W + 1, V M)`` forwards' activations at once:
  ``PP - r`` micro-batches of the stage's layers with plain 1F1B, and with interleaving
  ``min(2 (PP - r - 1) + (V - 1) N + 1, V M)`` (chunk, micro-batch) pairs of ``layers / V`` layers
  each: on rank 0 at ``N = PP`` about ``(1 + 1 / V)`` times plain 1F1B's layers' worth;
* ``get_schedule_table``: forward ``i`` is (micro-batch, chunk) of the table that runs groups of
  ``N`` micro-batches through chunk 0, 1, ..., ``V - 1`` in turn (the last group all that is
  left); backward ``i`` runs chunk ``V - 1 - chunk(i)`` on that chunk's oldest forward
  (``input_tensors[chunk].pop(0)``).

The trainer's ``N`` is the smallest megatron accepts for ``M``
(`megatron_rl.model.stages.interleaved_group_size`).

The bubble: with ``t`` the time of one micro-batch through one stage (forward and backward), the
ideal step is ``M t``, and 1F1B idles ``(PP - 1) t`` per step (fill and drain), i.e. bubble /
ideal ``= (PP - 1) / M``, or ``(PP - 1) / (M + PP - 1)`` of the step. Interleaving runs the fill
and drain with chunks of ``t / V``: ``(PP - 1) / (V M)`` of the ideal (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2),
at ``V`` times the point-to-point messages.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from megatron_rl.model.stages import interleaved_group_size

# the micro-batches a plan assumes when the schedule's M is not known: enough that no cap binds
# and every group holds PP of them (the steady state of a long pass)
ASSUMED_GROUPS = 4


def warmup_micro_batches(
    pipeline_parallel: int, rank: int, virtual: int, micro_batches: int, group: int
) -> int:
    """``num_warmup_microbatches`` of megatron's ``get_pp_rank_microbatches`` (training, no MoE
    overlap): ``PP - r - 1`` without interleaving (``virtual == 1``), else
    ``2 (PP - r - 1) + (V - 1) N``; both capped at the ``V M`` forwards of the pass."""
    total = virtual * micro_batches
    if pipeline_parallel == 1:
        return 0
    if virtual == 1:
        warmup = pipeline_parallel - rank - 1
    else:
        warmup = 2 * (pipeline_parallel - rank - 1) + (virtual - 1) * group
    return min(warmup, total)


def schedule_table(micro_batches: int, virtual: int, group: int) -> list[tuple[int, int]]:
    """megatron's ``get_schedule_table``: forward ``i`` of a rank is ``(micro-batch, chunk)``."""
    table = []
    for start in range(0, micro_batches, group):
        end = micro_batches if start + group >= micro_batches else start + group
        table += [(mb, chunk) for chunk in range(virtual) for mb in range(start, end)]
    return table


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """Step ``k`` of a rank's pass, when backward ``k`` starts: the (micro-batch, chunk) pairs
    whose activations are held (forwards done, backwards not), the newest forward (None in the
    cool-down) and the pair backward ``k`` runs (one of ``held``)."""

    held: tuple[tuple[int, int], ...]
    newest: tuple[int, int] | None
    backward: tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class RankSchedule:
    """One pipeline rank's training pass (see the module docstring)."""

    pipeline_parallel: int
    rank: int
    virtual: int
    micro_batches: int
    group: int
    warmup: int
    steps: tuple[Step, ...]

    @property
    def max_in_flight(self) -> int:
        """The most (chunk, micro-batch) pairs whose activations the rank holds at once:
        ``min(W + 1, V M)``."""
        return max(len(step.held) for step in self.steps)


def rank_schedule(
    pipeline_parallel: int, rank: int, virtual: int = 1, micro_batches: int | None = None
) -> RankSchedule:
    """The steps of ``rank``'s pass: ``micro_batches`` per update on a data-parallel rank (None:
    not known, ``ASSUMED_GROUPS x PP``, the steady state of a long pass; without interleaving
    ``PP``, which holds the most a rank ever does)."""
    pp = pipeline_parallel
    if not 0 <= rank < pp:
        raise ValueError(f"pipeline rank {rank}: must be in [0, {pp})")
    assumed = pp if virtual == 1 else ASSUMED_GROUPS * pp
    m = assumed if micro_batches is None else micro_batches
    if m < 1:
        raise ValueError(f"micro_batches={m}: must be >= 1")
    group = interleaved_group_size(m, pp) if virtual > 1 else m
    warmup = warmup_micro_batches(pp, rank, virtual, m, group)
    forwards = schedule_table(m, virtual, group)
    total = len(forwards)
    held: dict[int, deque[int]] = {chunk: deque() for chunk in range(virtual)}
    done = 0  # forwards run
    steps = []
    for k in range(total):
        last = min(warmup + k + 1, total)  # the steady state's forward W + k, then backward k
        while done < last:
            mb, chunk = forwards[done]
            held[chunk].append(mb)
            done += 1
        newest = forwards[warmup + k] if warmup + k < total else None
        chunk = virtual - 1 - forwards[k][1]
        pairs = tuple((mb, c) for c in range(virtual) for mb in held[c])
        steps.append(Step(pairs, newest, (held[chunk][0], chunk)))
        held[chunk].popleft()
    return RankSchedule(pp, rank, virtual, m, group, warmup, tuple(steps))


def bubble_fraction(pipeline_parallel: int, virtual: int, micro_batches: int) -> float:
    """Bubble time / ideal time of one update: ``(PP - 1) / (V M)`` (``V = 1``: 1F1B's
    ``(PP - 1) / M``)."""
    return (pipeline_parallel - 1) / (virtual * micro_batches)


def bubble_share(pipeline_parallel: int, virtual: int, micro_batches: int) -> float:
    """The bubble's share of the whole step: ``(PP - 1) / (V M + PP - 1)``."""
    return (pipeline_parallel - 1) / (virtual * micro_batches + pipeline_parallel - 1)
