"""Quantiles of per-token importance ratios over every update of a step, from a histogram.

The loss metrics average the ratio ``pi / pi_old``; its tail is what a trust region acts on and
what a train/rollout mismatch shows as (a token the trainer puts nats below the engine). Per
step the trainer counts, over the loss tokens of all N updates, the log-ratios

    d_old = log pi_theta - log pi_old   (the trainer's own policy when the rollout started),
    d_mu  = log pi_theta - log mu       (the engine's log-probs of the sampled tokens),

in a fixed histogram (`LOG_RATIO_EDGES`: 0 and +-10^e for e from -8 to 2 in steps of 0.02,
so a bin spans a factor 10^0.02 = 1.047 of |d|; |d| < 1e-8 falls in the bins next to 0, |d| >
100 in the outer ones). The counts of every data-parallel rank are summed, so the quantiles are
of the global step, not a mean of per-rank quantiles. A quantile is reported as the ratio
``exp(d)`` at the geometric middle of its bin's |d| edges: within 2.3% of |d|, i.e. exact to
``|d| * 0.023`` in log space.

Metrics: ``ratio/pi_old/q<q>`` and ``ratio/pi_mu/q<q>`` for q in `QUANTILES` (0.001, 0.01,
0.5, 0.99, 0.999).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)
_EXPONENTS = torch.arange(-800, 201, 2, dtype=torch.float64) / 100.0  # -8.00 .. 2.00
_POSITIVE = torch.pow(10.0, _EXPONENTS)
LOG_RATIO_EDGES = torch.cat([-_POSITIVE.flip(0), torch.zeros(1, dtype=torch.float64), _POSITIVE])
"""Sorted bin edges of the log-ratio histogram; bin ``i`` holds ``edges[i-1] < d <= edges[i]``
(bin 0: ``d <= edges[0]``, the last: ``d > edges[-1]``): d = 0 exactly (an update's first
forward, ratio 1) lands in the bin ``(-1e-8, 0]``."""
NUM_BINS = LOG_RATIO_EDGES.numel() + 1


def log_ratio_counts(log_ratio: torch.Tensor) -> torch.Tensor:
    """int64 ``[NUM_BINS]`` histogram of the (finite) values of ``log_ratio`` (any shape), on
    ``log_ratio``'s device."""
    values = log_ratio.detach().reshape(-1).double()  # on its device: no sync per micro-batch
    values = values[torch.isfinite(values)]
    bins = torch.bucketize(values, LOG_RATIO_EDGES.to(values.device))
    return torch.bincount(bins, minlength=NUM_BINS)


def _bin_log_ratio(b: int) -> float:
    """A representative log-ratio of bin ``b``: the geometric middle of its |d| edges (the
    outer bins: their inner edge; the two bins next to 0, |d| <= 1e-8: 0)."""
    edges = LOG_RATIO_EDGES
    if b == 0:
        return float(edges[0])
    if b == NUM_BINS - 1:
        return float(edges[-1])
    low, high = float(edges[b - 1]), float(edges[b])
    if low == 0.0 or high == 0.0:  # the bins between 0 and +-1e-8
        return 0.0
    sign = 1.0 if high > 0 else -1.0
    return sign * math.sqrt(abs(low) * abs(high))


def quantiles(counts: Sequence[float], qs: Sequence[float] = QUANTILES) -> list[float]:
    """The ratios ``exp(d_q)`` at quantiles ``qs`` of a histogram (`log_ratio_counts` summed
    over updates and ranks); nan for an empty histogram. ``d_q`` is the bin holding the
    ``ceil(q * n)``-th smallest value (the lower quantile), at `_bin_log_ratio`."""
    total = float(sum(counts))
    if total <= 0:
        return [math.nan] * len(qs)
    out = []
    cumulative = torch.cumsum(torch.tensor(list(counts), dtype=torch.float64), 0)
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q}: must be in [0, 1]")
        rank = max(1.0, math.ceil(q * total))
        b = int(torch.searchsorted(cumulative, torch.tensor(rank, dtype=torch.float64)))
        out.append(math.exp(_bin_log_ratio(min(b, NUM_BINS - 1))))
    return out


def quantile_metrics(name: str, counts: Sequence[float]) -> dict[str, float]:
    """``ratio/<name>/q<q>`` for every q of `QUANTILES` (module docstring)."""
    return {
        f"ratio/{name}/q{q:g}": value for q, value in zip(QUANTILES, quantiles(counts), strict=True)
    }
