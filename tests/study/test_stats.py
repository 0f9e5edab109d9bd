"""The study statistics: t quantiles against tables, the t-interval's coverage, edge cases."""

import math
import random
import statistics

import pytest

from megatron_rl.study import stats


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)],
)
def test_t_quantile_matches_the_table(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)
    assert stats.t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-4)


def test_t_cdf_of_one_degree_of_freedom_is_the_cauchy_cdf():
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_mean_ci_on_a_hand_computed_example():
    # x = 1..5: m = 3, s = sqrt(2.5), h = t_{0.975,4} * s / sqrt(5) = 2.776445 * 0.707107
    m, h = stats.mean_ci([1, 2, 3, 4, 5])
    assert m == 3.0
    assert h == pytest.approx(2.776445105 * math.sqrt(2.5) / math.sqrt(5), rel=1e-8)


def test_mean_ci_one_seed_is_an_infinite_interval_and_none_is_nan():
    assert stats.mean_ci([0.7]) == (0.7, math.inf)
    m, h = stats.mean_ci([None, float("nan")])
    assert math.isnan(m) and math.isnan(h)
    assert stats.mean_ci([2.0, None, 4.0])[0] == 3.0  # missing values are dropped


def test_t_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(0)
    trials, k, covered = 4000, 4, 0
    for _ in range(trials):
        m, h = stats.mean_ci([rng.gauss(1.5, 2.0) for _ in range(k)])
        covered += abs(m - 1.5) <= h
    # binomial sd at 95%: sqrt(.95 * .05 / 4000) = 0.0034; allow ~4 sd
    assert abs(covered / trials - 0.95) < 0.014


def test_welch_difference_interval():
    d, h = stats.welch_diff_ci([1, 2, 3], [1, 2, 3])
    assert d == 0.0 and h > 0
    d, h = stats.welch_diff_ci([10, 11, 12], [1, 2, 3])
    assert d == 9.0 and d - h > 0  # clearly different
    assert stats.welch_diff_ci([1.0], [2.0, 3.0])[1] == math.inf
    assert stats.welch_diff_ci([2, 2], [1, 1]) == (1.0, 0.0)
    # equal variances and sizes: nu = 2(K-1), h = t_{.975, 4} * sqrt(2 s^2 / K)
    d, h = stats.welch_diff_ci([1, 2, 3], [2, 3, 4])
    assert h == pytest.approx(stats.t_quantile(0.975, 4) * math.sqrt(2 / 3), rel=1e-9)


def test_run_summaries():
    assert stats.tail_mean([0.1, None, 0.5, 0.7], last=2) == pytest.approx(0.6)
    assert math.isnan(stats.tail_mean([], last=3))
    assert stats.first_step_reaching([1, 2, 3], [0.5, 0.95, 0.99], 0.9) == 2
    assert stats.first_step_reaching([1, 2], [0.5, None], 0.9) is None
    assert stats.spike_count([1.0, 1.1, 0.9, 3.5, 1.0]) == 1  # median 1.0: only 3.5 > 3.0
    assert stats.spike_count([]) == 0


def test_band_aligns_seeds_by_step():
    steps, means, halves = stats.band([{1: 1.0, 2: 2.0}, {1: 3.0}])
    assert steps == [1, 2] and means == [2.0, 2.0]
    expected = stats.t_quantile(0.975, 1) * statistics.stdev([1, 3]) / 2**0.5
    assert halves[0] == pytest.approx(expected)
    assert halves[1] == math.inf
