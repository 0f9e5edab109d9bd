"""Seed-paired comparison of two arms of a study (stdlib + numpy, no scipy).

Arms that share a seed share the warm start, the prompts and the evaluation seeds (common random
numbers), so two arms a and b are compared through the per-seed differences
d_s = a_s - b_s over the seeds s = 1..K that both ran (`paired_values`). With n = K differences,

* mean and spread:  dbar = (1/n) sum_s d_s,  s_d = sqrt( sum_s (d_s - dbar)^2 / (n - 1) ).
* paired t (`paired_t`):  t = dbar / (s_d / sqrt(n)) on n - 1 degrees of freedom; the two-sided
  ``confidence`` c interval  dbar +- t_{(1+c)/2, n-1} s_d / sqrt(n)  and the two-sided p-value
  p = 2 (1 - F_{n-1}(|t|)), F the Student-t CDF (`stats.t_cdf`). s_d = 0 (every difference
  equal): the interval is the point [dbar, dbar], and p = 0 if dbar != 0 else 1.
* sign-flip permutation test (`sign_flip_p`): under H0 each d_s is symmetric about 0, so all
  2^n sign assignments e in {-1, +1}^n are equally likely;
  p = #{e : |sum_s e_s d_s| >= |sum_s d_s| - tol} / 2^n, tol = 1e-12 sum_s |d_s| (ties).
  Its smallest value is 2 / 2^n (the observed signs and their mirror image).
* Wilcoxon signed-rank test (`signed_rank_p`): zero differences dropped (Wilcoxon's original
  convention), leaving n' nonzero ones; r_s = rank of |d_s| among them (ties get the average
  rank); W+ = sum of r_s over d_s > 0, E[W+] = n'(n'+1)/4 under H0;
  p = P(|W - E[W+]| >= |W+ - E[W+]|), W's exact null distribution over the 2^n' equally likely
  sign assignments of the ranks. All differences zero: p = 1.
* percentile bootstrap (`bootstrap_ci`): B resamples of the n seeds with replacement
  (numpy ``default_rng(seed)``), the statistic (mean or median) of each, and the interval
  [q_{(1-c)/2}, q_{(1+c)/2}] of those B values (numpy's linear-interpolation quantiles).
* Holm-Bonferroni (`holm`): the m p-values sorted, p_(0) <= ... <= p_(m-1);
  adjusted p_(k) = max_{j <= k} min(1, (m - j) p_(j)), returned in the input order.
* planning (`min_detectable_difference`, `seeds_needed`): a two-sided paired t-test at level
  alpha / m (Bonferroni over m comparisons, a conservative stand-in for Holm) detects a true mean
  difference delta with probability ~``power`` when
  delta >= MDD(n) = (t_{1 - alpha/(2m), n-1} + t_{power, n-1}) s_d / sqrt(n)
  (the usual normal-approximation formula with t quantiles; it slightly understates the n the
  noncentral t would ask for). seeds_needed = min{n >= 2 : MDD(n) <= delta}.
* normalised area under a curve (`area_under_curve`): points (x_0, v_0) < ... < (x_k, v_k) by
  step; AUC = sum_i (x_{i+1} - x_i)(v_i + v_{i+1}) / 2 / (x_k - x_0), so a flat curve at v gives v.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from megatron_rl.study.stats import t_cdf, t_quantile

SIGN_FLIP_MAX_N = 20  # 2^20 sign assignments (8 MiB of sums) is the exact test's ceiling


class PairedTest(NamedTuple):
    """A paired t-test: n differences, their mean, the interval [low, high] and the p-value."""

    n: int
    mean: float
    low: float
    high: float
    p: float


def _check_confidence(fn: str, confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"{fn}: confidence={confidence} must be in (0, 1), e.g. 0.95")


def _check_diffs(fn: str, diffs: Sequence[float]) -> list[float]:
    """The differences as floats; ValueError on a non-finite one or on fewer than 2."""
    xs = [float(d) for d in diffs]
    for i, x in enumerate(xs):
        if not math.isfinite(x):
            raise ValueError(
                f"{fn}: diffs[{i}]={x} is not finite; fix that seed's metric or drop the seed "
                "from both arms"
            )
    if len(xs) < 2:
        raise ValueError(
            f"{fn}: diffs has {len(xs)} value(s); need at least 2 seeds' differences "
            "(run more seeds)"
        )
    return xs


def paired_values(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[list[int], list[float]]:
    """``(seeds, diffs)``: the seeds both arms ran, sorted, and d_s = a[s] - b[s].

    Both arms must have run the same seeds (>= 2 of them), each with a finite value.
    """
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        missing = [f"b lacks seeds {only_a} that a has"] if only_a else []
        missing += [f"a lacks seeds {only_b} that b has"] if only_b else []
        raise ValueError(
            f"paired_values: {'; '.join(missing)}; run the missing seeds or restrict both arms "
            "to the same seeds"
        )
    seeds = sorted(a)
    if len(seeds) < 2:
        raise ValueError(
            f"paired_values: a and b share {len(seeds)} seed(s) {seeds}; need at least 2 "
            "(run more seeds)"
        )
    for s in seeds:
        if not (math.isfinite(float(a[s])) and math.isfinite(float(b[s]))):
            raise ValueError(
                f"paired_values: seed {s} has a non-finite value (a={a[s]}, b={b[s]}); fix or "
                "rerun that seed in both arms"
            )
    return seeds, [float(a[s]) - float(b[s]) for s in seeds]


def paired_t(diffs: Sequence[float], confidence: float = 0.95) -> PairedTest:
    """Paired t: dbar +- t_{(1+c)/2, n-1} s_d / sqrt(n), p = 2 (1 - F_{n-1}(|dbar| sqrt(n) / s_d)).

    s_d = 0: the interval is [dbar, dbar] and p = 0 if dbar != 0 else 1.
    """
    _check_confidence("paired_t", confidence)
    xs = _check_diffs("paired_t", diffs)
    n = len(xs)
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    if sd == 0.0:
        return PairedTest(n, m, m, m, 0.0 if m != 0.0 else 1.0)
    se = sd / math.sqrt(n)
    h = t_quantile((1.0 + confidence) / 2.0, n - 1) * se
    p = 2.0 * (1.0 - t_cdf(abs(m) / se, n - 1))
    return PairedTest(n, m, m - h, m + h, min(1.0, max(0.0, p)))


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact sign-flip p = #{e in {-1,1}^n : |sum e_s d_s| >= |sum d_s| - tol} / 2^n.

    tol = 1e-12 sum |d_s| counts floating-point ties as ties; n <= 20. The smallest p it can
    return is 2 / 2^n (8 seeds: 2/256 = 0.0078; 5 seeds: 0.0625), so p < 0.05 needs n >= 6
    seeds, and a Holm-adjusted p < 0.05 over m comparisons needs 2^n >= 40 m (m = 3: n >= 7).
    """
    xs = _check_diffs("sign_flip_p", diffs)
    if len(xs) > SIGN_FLIP_MAX_N:
        raise ValueError(
            f"sign_flip_p: diffs has {len(xs)} values, above the exact test's limit of "
            f"{SIGN_FLIP_MAX_N} (2^n sign assignments); use paired_t or signed_rank_p"
        )
    sums = np.zeros(1)
    for x in xs:
        sums = np.concatenate((sums + x, sums - x))
    observed = abs(float(sums[0]))  # index 0 is the all-plus assignment: the observed signs
    tol = 1e-12 * sum(abs(x) for x in xs)
    return int(np.count_nonzero(np.abs(sums) >= observed - tol)) / len(sums)


def _doubled_average_ranks(values: Sequence[float]) -> list[int]:
    """2 x the average rank (1-based) of each value; exactly equal values share their rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + 1) + (j + 1)  # 2 x the average of ranks i+1..j+1
        i = j + 1
    return ranks


def signed_rank_p(diffs: Sequence[float]) -> float:
    """Exact Wilcoxon signed-rank p = P(|W - n'(n'+1)/4| >= |W+ - n'(n'+1)/4|) under H0.

    Zeros dropped, average ranks of |d| for ties; W's null distribution is counted exactly over
    the 2^n' sign assignments of the ranks (a subset-sum recursion on 2 x ranks, all integers).
    All differences zero: 1.0.
    """
    xs = _check_diffs("signed_rank_p", diffs)
    nonzero = [x for x in xs if x != 0.0]
    if not nonzero:
        return 1.0
    ranks2 = _doubled_average_ranks([abs(x) for x in nonzero])
    total = sum(ranks2)  # = n'(n'+1), even: the centre total / 2 is an integer
    w_plus = sum(r for r, x in zip(ranks2, nonzero, strict=True) if x > 0)
    probs = np.zeros(total + 1)
    probs[0] = 1.0
    for r in ranks2:  # each rank joins W+ with probability 1/2
        shifted = np.zeros_like(probs)
        shifted[r:] = probs[:-r]
        probs = 0.5 * (probs + shifted)
    centre = total // 2
    dev = abs(w_plus - centre)
    extreme = np.abs(np.arange(total + 1) - centre) >= dev
    return min(1.0, float(probs[extreme].sum()))


def bootstrap_ci(
    diffs: Sequence[float],
    statistic: str = "mean",
    confidence: float = 0.95,
    resamples: int = 10000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap ``(q_{(1-c)/2}, q_{(1+c)/2})`` of the mean or median over seeds.

    ``resamples`` resamples of the n differences with replacement from ``default_rng(seed)``:
    the same arguments give the same interval.
    """
    _check_confidence("bootstrap_ci", confidence)
    xs = _check_diffs("bootstrap_ci", diffs)
    reducers = {"mean": np.mean, "median": np.median}
    if statistic not in reducers:
        raise ValueError(
            f"bootstrap_ci: statistic={statistic!r} is not one of {sorted(reducers)}; pass "
            "'mean' or 'median'"
        )
    if resamples < 1:
        raise ValueError(f"bootstrap_ci: resamples={resamples} must be >= 1, e.g. 10000")
    data = np.asarray(xs)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(data), size=(resamples, len(data)))
    values = reducers[statistic](data[idx], axis=1)
    low, high = np.quantile(values, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(low), float(high)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-Bonferroni: adjusted p_(k) = max_{j <= k} min(1, (m - j) p_(j)) over the sorted p,
    returned in the input order."""
    ps = [float(p) for p in pvalues]
    for i, p in enumerate(ps):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"holm: pvalues[{i}]={p} is outside [0, 1]; pass p-values only")
    m = len(ps)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: ps[i])):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def _check_planning(fn: str, sd_diff: float, comparisons: int, alpha: float, power: float) -> None:
    if not (math.isfinite(sd_diff) and sd_diff >= 0.0):
        raise ValueError(f"{fn}: sd_diff={sd_diff} must be a finite number >= 0")
    if comparisons < 1:
        raise ValueError(f"{fn}: comparisons={comparisons} must be >= 1 (the number of tests)")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"{fn}: alpha={alpha} must be in (0, 1), e.g. 0.05")
    if not 0.0 < power < 1.0:
        raise ValueError(f"{fn}: power={power} must be in (0, 1), e.g. 0.8")


def min_detectable_difference(
    sd_diff: float, n: int, comparisons: int = 1, alpha: float = 0.05, power: float = 0.8
) -> float:
    """MDD = (t_{1 - alpha/(2m), n-1} + t_{power, n-1}) sd_diff / sqrt(n), m = ``comparisons``."""
    _check_planning("min_detectable_difference", sd_diff, comparisons, alpha, power)
    if n < 2:
        raise ValueError(f"min_detectable_difference: n={n} must be >= 2 seeds")
    df = n - 1
    crit = t_quantile(1.0 - alpha / (2.0 * comparisons), df)
    return (crit + t_quantile(power, df)) * sd_diff / math.sqrt(n)


def seeds_needed(
    sd_diff: float,
    delta: float,
    comparisons: int = 1,
    alpha: float = 0.05,
    power: float = 0.8,
    max_seeds: int = 200,
) -> int:
    """The smallest n >= 2 with `min_detectable_difference` (sd_diff, n, ...) <= delta."""
    _check_planning("seeds_needed", sd_diff, comparisons, alpha, power)
    if not (math.isfinite(delta) and delta > 0.0):
        raise ValueError(f"seeds_needed: delta={delta} must be a finite number > 0")
    for n in range(2, max_seeds + 1):
        if min_detectable_difference(sd_diff, n, comparisons, alpha, power) <= delta:
            return n
    raise ValueError(
        f"seeds_needed: no n <= max_seeds={max_seeds} detects delta={delta} at "
        f"sd_diff={sd_diff}; raise max_seeds, accept a larger delta or reduce the variance"
    )


def area_under_curve(curve: Mapping[int, float]) -> float:
    """Normalised AUC = sum_i (x_{i+1} - x_i)(v_i + v_{i+1}) / 2 / (x_last - x_first) over steps."""
    steps = sorted(curve)
    if len(steps) < 2:
        raise ValueError(
            f"area_under_curve: curve has {len(steps)} point(s); need at least 2 steps"
        )
    for step in steps:
        if not math.isfinite(float(curve[step])):
            raise ValueError(
                f"area_under_curve: step {step} has a non-finite value {curve[step]}; drop or "
                "fix that point"
            )
    area = sum(
        (x1 - x0) * (float(curve[x0]) + float(curve[x1])) / 2.0 for x0, x1 in pairwise(steps)
    )
    return area / (steps[-1] - steps[0])
