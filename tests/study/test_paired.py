"""The seed-paired statistics: hand-computed values, brute-force enumerations, the paired
t-interval's coverage, planning consistency and every ValueError path."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from megatron_rl.study import paired

# --- paired_values ---------------------------------------------------------------------------


def test_paired_values_sorts_common_seeds_and_subtracts_b_from_a():
    seeds, diffs = paired.paired_values({3: 1.0, 1: 2.0, 2: 3.0}, {2: 1.0, 3: 0.5, 1: 1.0})
    assert seeds == [1, 2, 3]
    assert diffs == [1.0, 2.0, 0.5]


def test_paired_values_names_the_seeds_each_arm_lacks():
    with pytest.raises(ValueError, match=r"b lacks seeds \[3\] that a has; a lacks seeds \[4, 5\]"):
        paired.paired_values({1: 0.0, 2: 0.0, 3: 0.0}, {1: 0.0, 2: 0.0, 4: 0.0, 5: 0.0})
    with pytest.raises(ValueError, match=r"a lacks seeds \[9\] that b has; run the missing"):
        paired.paired_values({1: 0.0, 2: 0.0}, {1: 0.0, 2: 0.0, 9: 0.0})


def test_paired_values_needs_two_common_seeds():
    with pytest.raises(ValueError, match=r"share 1 seed\(s\) \[7\]; need at least 2"):
        paired.paired_values({7: 1.0}, {7: 0.0})


def test_paired_values_names_the_seed_with_a_non_finite_value():
    with pytest.raises(ValueError, match="seed 2 has a non-finite value"):
        paired.paired_values({1: 1.0, 2: math.nan}, {1: 0.0, 2: 0.0})
    with pytest.raises(ValueError, match="seed 1 has a non-finite value"):
        paired.paired_values({1: 1.0, 2: 1.0}, {1: math.inf, 2: 0.0})


# --- paired_t --------------------------------------------------------------------------------


def test_paired_t_matches_closed_forms_for_two_degrees_of_freedom():
    # d = [1, 2, 4]: mean 7/3, s^2 = ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3, se = sqrt(7/9).
    # df = 2 has closed forms: F(t) = 1/2 + t / (2 sqrt(2 + t^2)),
    # quantile t_p = (2p - 1) / sqrt(2 p (1 - p)).
    mean, se = 7 / 3, math.sqrt(7 / 9)
    t_crit = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025)  # 4.302653
    t = mean / se
    p = 2 * (1 - (0.5 + t / (2 * math.sqrt(2 + t * t))))
    result = paired.paired_t([1.0, 2.0, 4.0])
    assert result.n == 3
    assert result.mean == pytest.approx(mean, rel=1e-12)
    assert result.low == pytest.approx(mean - t_crit * se, rel=1e-9)
    assert result.high == pytest.approx(mean + t_crit * se, rel=1e-9)
    assert result.p == pytest.approx(p, rel=1e-9)


def test_paired_t_matches_closed_forms_for_three_degrees_of_freedom():
    # d = [1, 2, 3, 6]: mean 3, s^2 = 14/3, se = sqrt(14/3) / 2; t_{0.975,3} = 3.182446 (table);
    # df = 3: F(t) = 1/2 + (theta + sin(theta) cos(theta)) / pi, theta = atan(t / sqrt(3)).
    se = math.sqrt(14 / 3) / 2
    theta = math.atan(3 / se / math.sqrt(3))
    p = 2 * (1 - (0.5 + (theta + math.sin(theta) * math.cos(theta)) / math.pi))
    result = paired.paired_t([1, 2, 3, 6])
    assert result.p == pytest.approx(p, rel=1e-9)
    assert result.high - result.mean == pytest.approx(3.182446305 * se, rel=1e-8)
    assert 0.05 < result.p < 0.1  # t = 2.78 on 3 df


def test_paired_t_with_zero_spread_is_a_point_interval():
    assert paired.paired_t([0.5, 0.5, 0.5]) == paired.PairedTest(3, 0.5, 0.5, 0.5, 0.0)
    assert paired.paired_t([0.0, 0.0]) == paired.PairedTest(2, 0.0, 0.0, 0.0, 1.0)


def test_paired_t_interval_covers_the_true_mean_difference_about_95_percent():
    rng = np.random.default_rng(0)
    trials, true_mean = 2000, 0.3
    samples = rng.normal(true_mean, 1.0, size=(trials, 5))
    covered = sum(r.low <= true_mean <= r.high for r in map(paired.paired_t, samples))
    # binomial sd at 95%: sqrt(.95 * .05 / 2000) = 0.0049; the band is ~4 sd
    assert 0.93 <= covered / trials <= 0.97


def test_paired_t_rejects_bad_input():
    with pytest.raises(ValueError, match=r"paired_t: confidence=1.5 must be in \(0, 1\)"):
        paired.paired_t([1.0, 2.0], confidence=1.5)
    with pytest.raises(ValueError, match="paired_t: diffs has 1 value"):
        paired.paired_t([1.0])
    with pytest.raises(ValueError, match=r"paired_t: diffs\[1\]=nan is not finite"):
        paired.paired_t([1.0, math.nan])


# --- sign_flip_p -----------------------------------------------------------------------------


def test_sign_flip_p_hand_computed_values():
    # [1, 2, 3]: sums over the 8 sign assignments are +-6, +-4, +-2, +-0; |sum| >= 6 twice
    assert paired.sign_flip_p([1, 2, 3]) == 0.25
    assert paired.sign_flip_p([0.4] * 8) == 2 / 256  # the smallest p for 8 seeds: 0.0078
    assert paired.sign_flip_p([1.0, -1.0]) == 1.0


def _exact_sign_flip_p(diffs):
    """The sign-flip p in exact rational arithmetic (decimal inputs), by brute force."""
    exact = [Fraction(str(d)) for d in diffs]
    observed = abs(sum(exact))
    hits = sum(
        abs(sum(e * d for e, d in zip(signs, exact, strict=True))) >= observed
        for signs in itertools.product((1, -1), repeat=len(exact))
    )
    return hits / 2 ** len(exact)


def test_sign_flip_p_counts_floating_point_ties_as_ties():
    # the observed 0.9 + 0.9 - 0.2 - 0.7 = 0.9 ties 0.9 - 0.9 + 0.2 + 0.7 = 0.9 exactly, but the
    # float sums differ in the last bit: without the 1e-12 tolerance p would be 0.5, not 0.75
    assert _exact_sign_flip_p([0.9, 0.9, -0.2, -0.7]) == 0.75
    assert paired.sign_flip_p([0.9, 0.9, -0.2, -0.7]) == 0.75
    assert paired.sign_flip_p([0.4, 0.3, -0.3, -0.5]) == 1.0  # the exact sum is 0


@pytest.mark.parametrize(
    "diffs", [[0.7, -0.2, 1.1, 0.4, -0.5, 0.9], [0.3, -0.1, -0.2, 0.4], [2.5, 1.5, -0.5, 3.0, 1.0]]
)
def test_sign_flip_p_matches_exact_brute_force_enumeration(diffs):
    assert paired.sign_flip_p(diffs) == _exact_sign_flip_p(diffs)


def test_sign_flip_p_refuses_more_than_twenty_differences():
    assert paired.sign_flip_p([1.0] * 20) == 2 / 2**20
    with pytest.raises(ValueError, match="21 values, above the exact test's limit of 20"):
        paired.sign_flip_p([1.0] * 21)
    with pytest.raises(ValueError, match=r"sign_flip_p: diffs\[0\]=inf is not finite"):
        paired.sign_flip_p([math.inf, 1.0])


# --- signed_rank_p ---------------------------------------------------------------------------


def test_signed_rank_p_matches_table_values():
    assert paired.signed_rank_p([0.3] * 8) == pytest.approx(2 / 256, rel=1e-12)
    # n = 10, T = min(W+, W-) = 1 + 3 + 4 = 8: P(T <= 8) = 25/1024 (the 5% two-sided critical
    # value of the Wilcoxon table), so the two-sided p is 50/1024
    diffs = [-1, 2, -3, -4, 5, 6, 7, 8, 9, 10]
    assert paired.signed_rank_p(diffs) == pytest.approx(50 / 1024, rel=1e-12)


def _brute_force_signed_rank_p(diffs):
    """T = min(W+, W-) and the share of sign assignments with T' <= T (a different route)."""
    nonzero = [d for d in diffs if d != 0]
    mags = [abs(d) for d in nonzero]
    ranks = [
        sum(m < x for m in mags) + (sum(m == x for m in mags) + 1) / 2 for x in mags
    ]  # average rank: the number below plus the middle of the tied block
    w_plus = sum(r for r, d in zip(ranks, nonzero, strict=True) if d > 0)
    t_obs = min(w_plus, sum(ranks) - w_plus)
    hits = 0
    for signs in itertools.product((0, 1), repeat=len(ranks)):
        w = sum(r for r, s in zip(ranks, signs, strict=True) if s)
        hits += min(w, sum(ranks) - w) <= t_obs
    return hits / 2 ** len(ranks)


@pytest.mark.parametrize(
    "diffs",
    [
        [0.5, -1.2, 2.0, 2.0, -0.5, 3.1, 0.0, 1.7],  # ties at 0.5 and 2.0, one zero dropped
        [1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0],
        [-0.3, -0.1, 0.2, -0.4, -0.4, -0.4],
    ],
)
def test_signed_rank_p_matches_brute_force_enumeration(diffs):
    assert paired.signed_rank_p(diffs) == pytest.approx(_brute_force_signed_rank_p(diffs))


def test_signed_rank_p_is_one_when_every_difference_is_zero():
    assert paired.signed_rank_p([0.0, 0.0, 0.0]) == 1.0
    assert paired.signed_rank_p([0.0, 0.0, 2.0]) == 1.0  # one nonzero: W+ = 1 or 0, both extreme
    with pytest.raises(ValueError, match="signed_rank_p: diffs has 0 value"):
        paired.signed_rank_p([])


# --- bootstrap_ci ----------------------------------------------------------------------------

DIFFS = [0.12, 0.35, -0.05, 0.22, 0.41, 0.08, 0.30, 0.18]


def test_bootstrap_ci_is_deterministic_and_contains_the_sample_mean():
    low, high = paired.bootstrap_ci(DIFFS)
    assert (low, high) == paired.bootstrap_ci(DIFFS, seed=0)
    assert (low, high) != paired.bootstrap_ci(DIFFS, seed=1)
    assert low < float(np.mean(DIFFS)) < high
    m_low, m_high = paired.bootstrap_ci(DIFFS, statistic="median", resamples=2000, seed=3)
    assert m_low <= float(np.median(DIFFS)) <= m_high
    narrow = paired.bootstrap_ci(DIFFS, confidence=0.5)
    assert low < narrow[0] < narrow[1] < high


def test_bootstrap_ci_of_a_large_sample_is_close_to_the_normal_interval():
    x = np.random.default_rng(1).normal(0.0, 1.0, size=400)
    low, high = paired.bootstrap_ci(x, resamples=4000)
    half = 1.96 * float(np.std(x, ddof=1)) / math.sqrt(len(x))
    assert high - low == pytest.approx(2 * half, rel=0.1)


def test_bootstrap_ci_rejects_bad_input():
    with pytest.raises(ValueError, match=r"statistic='trimmed' is not one of \['mean', 'median'\]"):
        paired.bootstrap_ci(DIFFS, statistic="trimmed")
    with pytest.raises(ValueError, match="bootstrap_ci: resamples=0 must be >= 1"):
        paired.bootstrap_ci(DIFFS, resamples=0)
    with pytest.raises(ValueError, match=r"bootstrap_ci: confidence=0 must be in \(0, 1\)"):
        paired.bootstrap_ci(DIFFS, confidence=0)
    with pytest.raises(ValueError, match=r"bootstrap_ci: diffs\[2\]=nan is not finite"):
        paired.bootstrap_ci([1.0, 2.0, math.nan])


# --- holm ------------------------------------------------------------------------------------


def test_holm_matches_hand_computed_example():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> max 0.06
    adjusted = paired.holm([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=1e-12)


def test_holm_caps_at_one_keeps_order_and_is_monotone():
    ps = [0.9, 0.002, 0.6, 0.02, 0.3]
    adjusted = paired.holm(ps)
    assert adjusted == pytest.approx([1.0, 0.01, 1.0, 0.08, 0.9])
    by_p = [adjusted[i] for i in sorted(range(len(ps)), key=ps.__getitem__)]
    assert by_p == sorted(by_p)
    assert all(a >= p for a, p in zip(adjusted, ps, strict=True))
    assert paired.holm([]) == []
    assert paired.holm([0.04]) == [0.04]


def test_holm_rejects_a_p_value_outside_the_unit_interval():
    with pytest.raises(ValueError, match=r"holm: pvalues\[1\]=1.5 is outside \[0, 1\]"):
        paired.holm([0.1, 1.5])
    with pytest.raises(ValueError, match=r"holm: pvalues\[0\]=-0.01 is outside"):
        paired.holm([-0.01])
    with pytest.raises(ValueError, match=r"holm: pvalues\[0\]=nan is outside"):
        paired.holm([math.nan])


# --- min_detectable_difference / seeds_needed ------------------------------------------------


def test_min_detectable_difference_matches_table_quantiles():
    # n = 10: t_{0.975, 9} = 2.2622, t_{0.80, 9} = 0.8834 (tables); (2.2622 + 0.8834) / sqrt(10)
    assert paired.min_detectable_difference(1.0, 10) == pytest.approx(0.99472, abs=2e-4)
    assert paired.min_detectable_difference(2.0, 10) == pytest.approx(2 * 0.99472, abs=4e-4)
    assert paired.min_detectable_difference(0.0, 10) == 0.0


def test_min_detectable_difference_decreases_with_seeds_and_grows_with_comparisons():
    mdds = [paired.min_detectable_difference(1.0, n) for n in range(2, 40)]
    assert all(a > b for a, b in itertools.pairwise(mdds))
    one, three = (paired.min_detectable_difference(1.0, 8, comparisons=m) for m in (1, 3))
    assert three > one
    assert paired.min_detectable_difference(1.0, 8, power=0.9) > one


def test_seeds_needed_is_the_first_n_whose_mdd_reaches_delta():
    for sd, delta, m in [(1.0, 0.5, 1), (1.0, 0.5, 3), (0.2, 0.05, 2), (0.5, 10.0, 1)]:
        n = paired.seeds_needed(sd, delta, comparisons=m)
        assert paired.min_detectable_difference(sd, n, comparisons=m) <= delta
        if n > 2:
            assert paired.min_detectable_difference(sd, n - 1, comparisons=m) > delta
    assert paired.seeds_needed(0.5, 10.0) == 2  # MDD(2) = 14.08 x 0.5 / sqrt(2) = 4.98
    assert paired.seeds_needed(1.0, 0.5, comparisons=3) > paired.seeds_needed(1.0, 0.5)


def test_planning_rejects_bad_input():
    with pytest.raises(ValueError, match="min_detectable_difference: n=1 must be >= 2"):
        paired.min_detectable_difference(1.0, 1)
    with pytest.raises(ValueError, match=r"sd_diff=-1\.0 must be a finite number >= 0"):
        paired.min_detectable_difference(-1.0, 5)
    with pytest.raises(ValueError, match="comparisons=0 must be >= 1"):
        paired.min_detectable_difference(1.0, 5, comparisons=0)
    with pytest.raises(ValueError, match=r"alpha=1.0 must be in \(0, 1\)"):
        paired.min_detectable_difference(1.0, 5, alpha=1.0)
    with pytest.raises(ValueError, match=r"power=0 must be in \(0, 1\)"):
        paired.seeds_needed(1.0, 0.5, power=0)
    with pytest.raises(ValueError, match=r"seeds_needed: delta=0\.0 must be a finite number > 0"):
        paired.seeds_needed(1.0, 0.0)
    with pytest.raises(ValueError, match=r"no n <= max_seeds=10 detects delta=0\.1"):
        paired.seeds_needed(1.0, 0.1, max_seeds=10)


# --- area_under_curve ------------------------------------------------------------------------


def test_area_under_curve_of_flat_and_linear_curves():
    assert paired.area_under_curve({0: 0.7, 50: 0.7, 100: 0.7}) == pytest.approx(0.7)
    assert paired.area_under_curve({s: s / 10 for s in range(0, 101, 10)}) == pytest.approx(5.0)
    assert paired.area_under_curve({10: 2.0, 0: 0.0}) == pytest.approx(1.0)  # order-free


def test_area_under_curve_weights_points_by_step_spacing():
    # trapezoids: (1 - 0) * (0 + 1) / 2 = 0.5 and (10 - 1) * (1 + 1) / 2 = 9, over a span of 10
    assert paired.area_under_curve({0: 0.0, 1: 1.0, 10: 1.0}) == pytest.approx(0.95)


def test_area_under_curve_rejects_short_or_non_finite_curves():
    with pytest.raises(ValueError, match=r"curve has 1 point\(s\); need at least 2 steps"):
        paired.area_under_curve({5: 1.0})
    with pytest.raises(ValueError, match="step 20 has a non-finite value nan"):
        paired.area_under_curve({10: 1.0, 20: math.nan, 30: 1.0})
