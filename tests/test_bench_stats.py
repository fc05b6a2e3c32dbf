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


def test_sd_ratio_ci_hand_values():
    # 5 and 5 seeds: F(0.975; 4, 4) = 9.6045 (F table), sqrt 3.0991: ratio 0.025 / 0.005 = 5 -> [1.6134, 15.496]
    r = st.sd_ratio_ci(0.025, 5, 0.005, 5)
    assert r["mean"] == pytest.approx(5.0) and r["n"] == (5, 5)
    assert r["low"] == pytest.approx(5 / 3.0991, abs=1e-3) and r["high"] == pytest.approx(5 * 3.0991, abs=1e-2)
    # 3 and 6 values, the degrees of freedom in order: low = 2 / sqrt(F(0.975; 2, 5) = 8.4336) = 0.6887,
    # high = 2 x sqrt(F(0.975; 5, 2) = 39.298) = 12.538
    r = st.sd_ratio_ci(0.2, 3, 0.1, 6)
    assert r["low"] == pytest.approx(0.6887, abs=1e-3) and r["high"] == pytest.approx(12.538, abs=1e-2)
    assert math.isnan(st.sd_ratio_ci(0.2, 1, 0.1, 6)["low"]) and st.sd_ratio_ci(0.2, 3, 0.0, 6)["mean"] == math.inf
    with pytest.raises(ValueError, match="standard deviations"):
        st.sd_ratio_ci(-0.1, 3, 0.1, 3)


ttt = load_benchmark("_ttt_report")


def _run(method, seed, points, setup_s=10.0):
    return {"method": method, "seed": seed, "setup_s": setup_s, "train_s": points[-1][0], "steps": 10,
            "points": [{"train_s": t, "accuracy": a, "step": i} for i, (t, a) in enumerate(points)]}


def test_first_passage_and_accuracy_at_budget():
    run = _run("async", 0, [(15, 0.30), (30, 0.42), (45, 0.38), (60, 0.47)], setup_s=12.0)
    assert ttt.first_passage(run, 0.40) == (30, True)  # the first eval at or above, not the best one
    assert ttt.first_passage(run, 0.40, with_setup=True) == (42.0, True)
    assert ttt.first_passage(run, 0.50) == (60, False)  # censored at the last eval
    assert ttt.first_step(run, 0.40) == 1 and ttt.first_step(run, 0.45) == 3 and ttt.first_step(run, 0.5) is None
    assert ttt.accuracy_at(run, 10, base=0.25) == 0.25  # before the first eval: the base
    assert ttt.accuracy_at(run, 50, base=0.25) == 0.38  # the last eval at or before the budget
    assert ttt.accuracy_at(run, 999, base=0.25) == 0.47


def test_summary_and_paired_comparison_from_points():
    # async reaches 0.40 at 15 s in every seed, sync at 30 s: ratio 2 with a point interval
    runs = [_run("async", s, [(15, 0.41), (30, 0.45)]) for s in range(3)] + \
        [_run("sync", s, [(15, 0.35), (30, 0.40)]) for s in range(3)]
    summary = ttt.summarize(runs, ["async", "sync"], {"base+0.10": 0.40}, [15.0], base=0.30)
    assert summary["async"]["targets"]["base+0.10"]["train"]["km_median_s"] == 15
    assert summary["sync"]["targets"]["base+0.10"]["with_setup"]["km_median_s"] == 40  # 30 s + 10 s setup
    assert summary["sync"]["budget_accuracy"]["15.0"]["mean"] == pytest.approx(0.35)
    (cmp,) = ttt.compare(runs, {"base+0.10": 0.40}, [15.0], base=0.30)
    assert (cmp["num"], cmp["den"]) == ("sync", "async")
    assert cmp["ratio"]["base+0.10/train"]["ratio"] == pytest.approx(2.0)
    assert cmp["ratio"]["base+0.10/train"]["low"] == pytest.approx(2.0)
    # accuracy at 15 s: async 0.41 minus sync 0.35 in every pair
    assert cmp["budget_difference"]["15.0"]["mean"] == pytest.approx(0.06)


def test_time_to_target_curve_keeps_steps_and_eval_points(tmp_path):
    from tba.logger import eval_series

    harness, common = load_benchmark("time_to_target"), load_benchmark("_common")
    steps = [{"step": s, "train_s": 10.0 * s, "reward/mean": 0.1 * s} for s in (1, 2, 3)]
    points = [{"train_s": 20.5, "step": 2, "samples": 64, "accuracy": 0.30, "stderr": 0.02, "n": 400,
               "eval_s": 9.0},
              {"train_s": 30.5, "step": 3, "samples": 96, "accuracy": 0.35, "stderr": 0.03, "n": 400,
               "eval_s": 9.0}]
    path = harness.save_curve(tmp_path, "async", 1, steps, points)
    assert path == str(tmp_path / "curves" / "async-s1.jsonl.gz")
    recs = common.read_jsonl_gz(tmp_path / "curves" / "async-s1.jsonl.gz")
    # step order, a step's eval after its metrics; the eval's own timing stays out
    assert [(r["step"], "eval/accuracy" in r) for r in recs] == [(1, False), (2, False), (2, True), (3, False),
                                                                 (3, True)]
    assert recs[2] == {"step": 2, "train_s": 20.5, "eval/accuracy": 0.30, "eval/stderr": 0.02, "eval/n": 400}
    assert recs[3]["reward/mean"] == pytest.approx(0.3)
    # the learning-curve reader sees the eval points with their standard errors
    assert eval_series(recs) == ("accuracy", [(2, 0.30, 0.02), (3, 0.35, 0.03)])
