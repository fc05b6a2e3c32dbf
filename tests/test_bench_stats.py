"""The benchmarks' statistics (benchmarks/_stats.py) against small examples worked out by hand."""

from __future__ import annotations

import math

import pytest
from conftest import load_benchmark

st = load_benchmark("_stats")


def test_km_median_all_reached_is_the_sample_median():
    # S(t) after each event: 4/5, 3/5, 2/5 -> first <= 1/2 at t = 3
    assert st.km_median([5, 1, 4, 2, 3], [True] * 5) == 3


def test_km_median_with_censored_runs():
    # times 1 2 3+ 4 5+ (+ = not reached, observed until then). At risk / events:
    # t=1: 5 at risk, S = 4/5; t=2: 4 at risk, S = 4/5 * 3/4 = 3/5; t=3 censored;
    # t=4: 2 at risk, S = 3/5 * 1/2 = 3/10 <= 1/2 -> median 4.
    # Counting the censored runs as reached at their budget would give 3; dropping them would give 2.
    assert st.km_median([1, 2, 3, 4, 5], [True, True, False, True, False]) == 4


def test_km_median_not_reached():
    # two of five reach: S ends at 3/5 > 1/2 -> the median is not reached
    assert st.km_median([1, 2, 9, 9, 9], [True, True, False, False, False]) == math.inf
    assert st.km_median([9, 9], [False, False]) == math.inf
    with pytest.raises(ValueError):
        st.km_median([1, 2], [True])


def test_paired_ratio_of_exact_multiples_has_a_point_interval():
    # every tba run is exactly 2.5x faster than its paired TRL run: every resample's ratio is 2.5
    trl = [100.0, 150.0, 210.0, 120.0, 180.0]
    tba = [t / 2.5 for t in trl]
    r = st.paired_ratio_ci(trl, [True] * 5, tba, [True] * 5, n_resamples=500)
    assert r["ratio"] == pytest.approx(2.5)
    assert r["low"] == pytest.approx(2.5) and r["high"] == pytest.approx(2.5) and r["n"] == 5


def test_paired_ratio_interval_covers_noise_and_opens_when_not_reached():
    trl = [100.0, 150.0, 210.0, 120.0, 180.0]
    tba = [50.0, 50.0, 100.0, 60.0, 45.0]  # ratios 2, 3, 2.1, 2, 4
    r = st.paired_ratio_ci(trl, [True] * 5, tba, [True] * 5, n_resamples=2000)
    # KM medians: 150 / 50 = 3; the bootstrap interval lies within the smallest and largest possible
    # ratio of medians of resampled pairs, and is not a point
    assert r["ratio"] == pytest.approx(3.0)
    assert 100 / 60 <= r["low"] < 3.0 < r["high"] <= 210 / 45
    # TRL never reaches the target: the ratio and its upper bound are unbounded
    never = st.paired_ratio_ci([300.0] * 5, [False] * 5, tba, [True] * 5, n_resamples=200)
    assert never["ratio"] == math.inf and never["high"] == math.inf


def test_mean_ci_hand_values():
    # mean 2, sd 1, n 3: half-width = t(0.975, 2) * 1 / sqrt(3) = 4.3027 / 1.7321 = 2.4841
    r = st.mean_ci([1.0, 2.0, 3.0])
    assert r["mean"] == 2.0
    assert r["low"] == pytest.approx(2 - 2.4841, abs=1e-3) and r["high"] == pytest.approx(2 + 2.4841, abs=1e-3)
    assert math.isnan(st.mean_ci([1.0])["low"])
    d = st.paired_difference_ci([0.5, 0.6, 0.7], [0.4, 0.4, 0.4])  # differences 0.1 0.2 0.3
    assert d["mean"] == pytest.approx(0.2) and d["low"] == pytest.approx(0.2 - 0.24841, abs=1e-4)
