"""Statistics of a study over seeds (pure Python, no scipy).

Every arm runs over K seeds; a metric gives one value per seed, x_1..x_K. The tool reports

* the mean  m = (1/K) sum_i x_i,
* the sample standard deviation  s = sqrt( sum_i (x_i - m)^2 / (K - 1) ),
* the two-sided ``confidence`` (default 95%) Student-t interval  m +- t_{(1+c)/2, K-1} s / sqrt(K).

With K = 1 there is no spread estimate (K - 1 = 0 degrees of freedom): the half-width is
``math.inf``, never a made-up number. Differences between two arms use Welch's interval (below).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) = B(x; a, b) / B(a, b), for 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta: x={x} is outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student-t CDF: P(T <= t) = 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2 for t >= 0 (symmetric)."""
    if df <= 0:
        raise ValueError(f"t_cdf: df={df} must be > 0")
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p (0 < p < 1), by bisection to 1e-12 relative precision."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p={p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


def finite(values: Sequence[float | None]) -> list[float]:
    """The values that are numbers (None and NaN dropped: a metric an arm does not report)."""
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """``(m, h)``: mean and half-width h = t_{(1+c)/2, K-1} s / sqrt(K) of the t-interval.

    K = 1: h = inf (no spread estimate). K = 0 (no finite value): (nan, nan).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1)")
    xs = finite(values)
    if not xs:
        return math.nan, math.nan
    m = statistics.fmean(xs)
    if len(xs) == 1:
        return m, math.inf
    s = statistics.stdev(xs)
    return m, t_quantile((1.0 + confidence) / 2.0, len(xs) - 1) * s / math.sqrt(len(xs))


def welch_diff_ci(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95
) -> tuple[float, float]:
    """``(d, h)``: d = mean(a) - mean(b) and its Welch t half-width.

    h = t_{(1+c)/2, nu} sqrt(s_a^2/K_a + s_b^2/K_b), with Welch-Satterthwaite degrees of freedom
    nu = (v_a + v_b)^2 / (v_a^2/(K_a-1) + v_b^2/(K_b-1)), v = s^2/K. Either arm with K < 2: h = inf.
    Both spreads zero: h = 0 (the values are identical within each arm).
    """
    xa, xb = finite(a), finite(b)
    if not xa or not xb:
        return math.nan, math.nan
    d = statistics.fmean(xa) - statistics.fmean(xb)
    if len(xa) < 2 or len(xb) < 2:
        return d, math.inf
    va = statistics.variance(xa) / len(xa)
    vb = statistics.variance(xb) / len(xb)
    if va + vb == 0:
        return d, 0.0
    nu = (va + vb) ** 2 / (va**2 / (len(xa) - 1) + vb**2 / (len(xb) - 1))
    return d, t_quantile((1.0 + confidence) / 2.0, nu) * math.sqrt(va + vb)


def tail_mean(values: Sequence[float | None], last: int) -> float:
    """Mean of the last ``last`` finite values (fewer if the run has fewer); nan if none."""
    if last < 1:
        raise ValueError(f"tail_mean: last={last} must be >= 1")
    xs = finite(values)[-last:]
    return statistics.fmean(xs) if xs else math.nan


def first_step_reaching(
    steps: Sequence[int], values: Sequence[float | None], threshold: float
) -> int | None:
    """The first step whose value is >= ``threshold``; None if no step reaches it."""
    for step, value in zip(steps, values, strict=True):
        if value is not None and not math.isnan(value) and value >= threshold:
            return int(step)
    return None


def spike_count(values: Sequence[float | None], factor: float = 3.0) -> int:
    """Steps whose value exceeds ``factor`` x the run's median (grad-norm spikes); 0 if empty."""
    xs = finite(values)
    if not xs:
        return 0
    limit = factor * statistics.median(xs)
    return sum(x > limit for x in xs)


def band(curves: Sequence[dict[int, float]], confidence: float = 0.95):
    """Per step over seeds: ``(steps, means, half_widths)``; a step needs >= 1 seed's value.

    ``curves``: one ``{step: value}`` per seed. Half-widths follow `mean_ci` (inf for one seed).
    """
    steps = sorted({step for curve in curves for step in curve})
    means, halves = [], []
    for step in steps:
        m, h = mean_ci([c[step] for c in curves if step in c], confidence)
        means.append(m)
        halves.append(h)
    return steps, means, halves
