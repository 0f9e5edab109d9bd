"""Token balancing: data-parallel shares by token count, micro-batches by a token budget.

Pure Python (no torch), so the batching policy can be tested against brute force and measured
in seconds (``megatron-rl bench batching``).

* `karmarkar_karp`: split item weights (sequence lengths) into ``k`` parts of near-equal sums,
  optionally with equal item counts (what data-parallel ranks need: every rank keeps
  ``global_batch / dp`` samples). The semantics of verl's ``get_seqlen_balanced_partitions``
  (also used by slime's ``--balance-data``); the implementation is written from the algorithm.
* `token_budget_micro_batches`: group samples into micro-batches whose *padded* size (rows x
  longest row, rounded up to ``seq_multiple``) stays within ``max_tokens``.
* `padded_tokens` / `padding_waste`: what a grouping costs in pad tokens.

Micro-batches are padded ``[b, s]`` tensors. Packing the rows into one ``[1, sum(len)]`` row
with ``cu_seqlens`` (THD layout) would remove the padding altogether, but needs Transformer
Engine's attention (the local CPU attention has no THD); it is not implemented here.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = [
    "karmarkar_karp",
    "padded_tokens",
    "padding_waste",
    "token_budget_micro_batches",
]


def karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` parts with near-equal weight sums.

    Largest differencing method (Karmarkar & Karp 1982, k-way form): every item starts as a
    partial solution of ``k`` subsets (the item in one, the others empty); with ``equal_size``
    the items are sorted and every ``k`` consecutive ones form a partial solution with one item
    per subset. Repeatedly the two partial solutions with the largest *spread* (largest minus
    smallest subset sum) are merged, pairing the heaviest subset of one with the lightest of
    the other, the second heaviest with the second lightest, and so on, until one is left.

    Guarantee (provable, and property-tested): merging never increases the spread beyond the
    larger of the two merged spreads (for sums ``a`` descending and ``b`` ascending,
    ``(a_i + b_i) - (a_j + b_j)`` is at most ``a_i - a_j`` for ``i < j`` and ``b_i - b_j`` for
    ``i > j``), so the final ``max(part) - min(part)`` is at most the largest initial spread:
    the largest weight, and with ``equal_size`` the largest gap between ``k`` consecutive sorted
    weights. Hence ``max(part) <= mean + max(weights)``. It is a heuristic, not an optimum.
    With ``equal_size`` every part has ``len(weights) / k`` items (which must be an integer).

    Deterministic: ties are broken by item index, so every rank computes the same partition.
    Parts are returned with their indices ascending, ordered by their smallest index.
    """
    n = len(weights)
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"k={k!r}: the number of parts must be an integer >= 1")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be >= 0 (token counts)")
    if equal_size and n % k:
        raise ValueError(f"equal_size: {n} items do not split into {k} parts of equal count")
    if n == 0:
        return [[] for _ in range(k)]
    # a partial solution: (sum, item indices) per subset, sorted by sum descending
    order = sorted(range(n), key=lambda i: (weights[i], i))
    step = k if equal_size else 1
    groups = [order[g : g + step] for g in range(0, n, step)]
    heap = []
    for tie, group in enumerate(groups):
        subsets = [(weights[i], [i]) for i in group] + [(0, []) for _ in range(k - len(group))]
        heap.append(_entry(subsets, tie))
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # first: sums descending; second reversed: ascending
        merged = [
            (sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(first, reversed(second), strict=True)
        ]
        heapq.heappush(heap, _entry(merged, tie))
        tie += 1
    parts = [sorted(indices) for _, indices in heap[0][2]]
    return sorted(parts, key=lambda p: (p[0] if p else n, len(p)))


def _entry(subsets: list[tuple[int, list[int]]], tie: int):
    """Heap entry: largest spread first, then the oldest partial solution."""
    subsets = sorted(subsets, key=lambda s: (-s[0], s[1][:1]))
    spread = subsets[0][0] - subsets[-1][0]
    return (-spread, tie, subsets)


def _round_up(length: int, multiple: int) -> int:
    return length + (-length) % multiple


def token_budget_micro_batches(
    lengths: Sequence[int], max_tokens: int, seq_multiple: int = 1
) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that every group's padded size fits ``max_tokens``.

    A group of rows is padded to its longest row rounded up to ``seq_multiple``, so its size is
    ``len(group) * round_up(max(lengths in group))``. A sample longer than the budget travels
    alone. The samples are sorted by length, longest first (ties: by index), so similar lengths
    share a micro-batch, and cut into consecutive runs by dynamic programming over the cut
    points: first the fewest micro-batches, then, among those, the fewest padded tokens
    (``O(n * rows per micro-batch)``).

    Guarantee (property-tested against every grouping of small inputs): no grouping under the
    budget has fewer micro-batches, and none with as few has fewer padded tokens. (Why sorted
    runs lose nothing: swapping a shorter member of one group for a longer member of a group
    with a longer maximum never raises either group's maximum, so some optimal grouping is
    runs of the sorted order.) Micro-batches come out longest first; indices within one are in
    sorted-length order.
    """
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens={max_tokens!r}: the token budget must be an integer >= 1")
    if seq_multiple < 1:
        raise ValueError(f"seq_multiple={seq_multiple}: must be >= 1")
    if any(n < 1 for n in lengths):
        raise ValueError("every sample needs at least one token")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    widths = [_round_up(lengths[i], seq_multiple) for i in order]
    n = len(order)
    # best[i]: (micro-batches, padded tokens) of the rows order[i:], and where its first run ends
    best: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    cut = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        rows = max(1, max_tokens // widths[i])  # order[i] is the run's longest row
        choice = None
        for j in range(i + 1, min(n, i + rows) + 1):
            count, padded = best[j]
            candidate = (count + 1, padded + (j - i) * widths[i])
            if choice is None or candidate < choice:
                choice, cut[i] = candidate, j
        best[i] = choice
    groups, i = [], 0
    while i < n:
        groups.append(order[i : cut[i]])
        i = cut[i]
    return groups


def padded_tokens(groups: Sequence[Sequence[int]], seq_multiple: int = 1) -> int:
    """Tokens of the padded micro-batches (rows x padded width), given each group's lengths."""
    return sum(len(g) * _round_up(max(g), seq_multiple) for g in groups if g)


def padding_waste(groups: Sequence[Sequence[int]], seq_multiple: int = 1) -> float:
    """Pad tokens per real token (0.0: no padding), given each micro-batch's row lengths."""
    real = sum(sum(g) for g in groups)
    if real == 0:
        return 0.0
    return padded_tokens(groups, seq_multiple) / real - 1.0
