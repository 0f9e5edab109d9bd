"""Forward-only passes over merged micro-batches: few large forwards, outputs split back.

The old-logprob pass and the KL reference's pass keep nothing of a forward but its per-token
numbers, so they need not run one forward per update micro-batch; on small micro-batches those
forwards are bound by per-call overhead. `forward_only_pass` runs the micro-batches as few
merged forwards as a token budget allows and gives every micro-batch what `run_pass` would:

* grouping (`plan_forwards`): micro-batches of equal width (with ``pad_widths``: of any width)
  cut into runs whose merged size ``sum(rows) x widest`` stays within ``max_tokens``; a
  micro-batch over the budget runs alone (it is never split);
* the merged batch (`merge_micro_batches`): members' rows in order, right-padded to the widest;
  member ``i`` gets the logits ``merged[r_i : r_i + b_i, : s_i]`` (a view) in ``on_logits(i, .)``;
* routing replay: R3 replays the members' engine routes concatenated (the merged batch's
  ``routed()``; padding rows get the pad route and are not counted); R2 records the merged
  forward under a key of its own and splits the recording into each member's key, rows in the
  member's own ``[s_i, b_i]`` order (`ReplayPasses.split_recording`), so that the updates replay
  it unchanged. Under R2 with sequence parallelism (TP > 1) nothing is merged (see
  `ReplayPasses.can_merge_behaviour`);
* pipeline parallelism: the merged batches go through `run_pass` like micro-batches (megatron's
  schedule with variable shapes); every stage derives the same grouping from the same shapes;
* data parallelism: forwards must pair up across data-parallel ranks (expert-parallel
  all-to-alls run between them), so with ``group`` the ranks agree on the largest number of
  forwards and a rank with fewer splits its largest merged batches (`split_to_count`); under
  interleaved pipeline parallelism there are at least PP forwards (megatron's schedule needs them).

A real token's result does not depend on what merging adds (rows of other micro-batches, padding
on the right) because: attention is causal within a row, so a position reads only positions
before it in its own row; norms, rope and the output layer act per token; MoE tokens are routed
and computed independently, which assumes no expert capacity (token dropping; megatron's
default ``moe_expert_capacity_factor=None``) and holds with an auxiliary loss (it changes
gradients, not the forward). Kernels may still sum in another order for another batch shape:
the log-probs are equal to float rounding (within 1e-6 on the tiny model; bitwise with one torch
thread on the development CPU when widths are equal, the default; tests/train/test_merged_pass.py),
and the positions merging adds are dropped with their routes. Bitwise matters beyond the metrics:
an update's first forward then sees ratios of exactly 1, as with one forward per micro-batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from megatron_rl.collectives import max_over_ranks
from megatron_rl.routing.passes import ReplayPasses
from megatron_rl.train.batch import MicroBatch, merge_micro_batches
from megatron_rl.train.pipeline import OnLogits, min_micro_batches, run_pass

# Padded tokens per merged forward when the update micro-batches have no token budget. A
# forward-only pass at this size holds one [tokens, V / tp] logits tensor and one layer's
# activations; a micro-batch larger than it runs alone, as before.
DEFAULT_MAX_FORWARD_TOKENS = 8192


def forward_token_budget(update_budget: int | None) -> int:
    """Padded tokens per merged forward: the update micro-batches' budget
    (``--max-tokens-per-gpu``: an update at that size holds more than a forward does), else
    `DEFAULT_MAX_FORWARD_TOKENS`."""
    return update_budget or DEFAULT_MAX_FORWARD_TOKENS


@dataclass(frozen=True, slots=True)
class MergedKey:
    """The replay key of merged forward ``index`` (never one of the micro-batches' keys)."""

    index: int


def plan_forwards(
    shapes: Sequence[tuple[int, int]], max_tokens: int, *, pad_widths: bool = False
) -> list[list[int]]:
    """Micro-batch indices grouped into merged forwards, given each one's ``(rows, width)``.

    The micro-batches are sorted by width, widest first (ties: by index), and cut greedily:
    a run grows while ``sum(rows) x its first width <= max_tokens`` and, unless
    ``pad_widths``, the widths are equal. Every sub-run of a run that fits fits too, so
    extending each run as far as it goes gives the fewest runs of that order. ``max_tokens``
    0: one forward per micro-batch (the unmerged pass).

    Equal widths keep every row's shape: only the number of rows of each kernel changes, and
    the log-probs are bitwise those of one forward per micro-batch on the CPU here.
    ``pad_widths`` merges narrower micro-batches too, padded to the widest: fewer forwards,
    equal to float rounding only (a short row's attention then sums over a longer key axis
    whose extra terms are zero, and a kernel may order a sum by its length; observed 1e-7).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(
            f"max_tokens={max_tokens!r}: padded tokens per merged forward must be an integer "
            ">= 0 (0: one forward per micro-batch)"
        )
    order = sorted(range(len(shapes)), key=lambda i: (-shapes[i][1], i))
    groups: list[list[int]] = []
    rows = width = 0
    for i in order:
        b, s = shapes[i]
        if groups and (rows + b) * width <= max_tokens and (pad_widths or s == width):
            groups[-1].append(i)
            rows += b
        else:
            groups.append([i])
            rows, width = b, s
    return groups


def split_to_count(groups: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``groups`` with the largest one (first of equals) halved until there are ``count``, or
    every group is a single micro-batch (no more forwards can be made)."""
    out = [list(g) for g in groups]
    while out and len(out) < count:
        j = max(range(len(out)), key=lambda n: (len(out[n]), -n))
        if len(out[j]) < 2:
            break
        half = (len(out[j]) + 1) // 2
        out[j : j + 1] = [out[j][:half], out[j][half:]]
    return out


def forward_only_pass(
    model,
    micro_batches: Sequence[MicroBatch],
    keys: Sequence[Hashable],
    replay: ReplayPasses,
    on_logits: OnLogits,
    *,
    max_tokens: int,
    pad_widths: bool = False,
    group=None,
) -> None:
    """`run_pass` with ``phase="behaviour"`` over merged micro-batches (module docstring).

    ``on_logits(i, logits_i)`` gets micro-batch ``i``'s ``[b_i, s_i, V / tp]`` logits (a view
    of its merged forward's) on the last pipeline stage, in merged-forward order, not index
    order; R2 leaves each micro-batch's recording under ``keys[i]``. ``max_tokens``: padded
    tokens per merged forward (0: one forward per micro-batch); ``pad_widths``: see
    `plan_forwards`. ``group``: the data-parallel group whose ranks must run as many forwards
    (None: one rank).
    """
    if len(keys) != len(micro_batches):
        raise ValueError(f"{len(keys)} keys for {len(micro_batches)} micro-batches: one each")
    shapes = [(mb.tokens_BS.shape[0], mb.tokens_BS.shape[1]) for mb in micro_batches]
    budget = max_tokens if replay.can_merge_behaviour() else 0
    groups = plan_forwards(shapes, budget, pad_widths=pad_widths)
    count = len(groups)
    if group is not None:
        (count,) = max_over_ranks([count], group)
    # the interleaved pipeline schedule needs >= PP forwards (the same on every stage)
    groups = split_to_count(groups, max(int(count), min_micro_batches()))
    batches, forward_keys = [], []
    for n, members in enumerate(groups):
        if len(members) == 1:
            batches.append(micro_batches[members[0]])
            forward_keys.append(keys[members[0]])
        else:
            batches.append(merge_micro_batches([micro_batches[i] for i in members]))
            forward_keys.append(MergedKey(n))

    def on_merged_logits(n: int, logits: torch.Tensor) -> None:
        first = 0
        for i in groups[n]:
            rows, width = shapes[i]
            on_logits(i, logits[first : first + rows, :width])
            first += rows

    run_pass(model, batches, forward_keys, replay, on_merged_logits, phase="behaviour")
    for members, batch, key in zip(groups, batches, forward_keys, strict=True):
        if len(members) > 1:
            parts, first = [], 0
            for i in members:
                parts.append((keys[i], first, *shapes[i]))
                first += shapes[i][0]
            replay.split_recording(key, batch.tokens_BS.shape[0], parts)
