"""Statistics for the benchmarks' claims: censored first-passage times, paired ratios, means with intervals.

Built on scipy (``scipy.stats.ecdf`` for Kaplan-Meier, ``scipy.stats.bootstrap`` for paired intervals,
Student's t for means, Fisher's F for ratios of standard deviations); nothing here is estimated by
hand-written code that a library already provides.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
from scipy import stats


def km_median(times: Sequence[float], reached: Sequence[bool]) -> float:
    """Kaplan-Meier median time to target of runs, some of which never reached it (right-censored at their
    last time): the earliest time at which the estimated share of runs still short of the target is <= 1/2.

    Args:
        times: per run, seconds to the target if reached, else the time it was last observed (its budget).
        reached: per run, whether it reached the target.

    Returns:
        The median in the units of ``times``; ``math.inf`` when fewer than half are estimated to reach it
        ("not reached").

    Raises:
        ValueError: empty input or mismatched lengths.
    """
    if not len(times) or len(times) != len(reached):
        raise ValueError(f"km_median needs one flag per time, got {len(times)} times, {len(reached)} flags")
    t = np.asarray(times, dtype=float)
    r = np.asarray(reached, dtype=bool)
    if not r.any():
        return math.inf
    sf = stats.ecdf(stats.CensoredData.right_censored(t, ~r)).sf
    below = np.nonzero(sf.probabilities <= 0.5 + 1e-12)[0]
    return float(sf.quantiles[below[0]]) if len(below) else math.inf


def paired_ratio_ci(num_times: Sequence[float], num_reached: Sequence[bool], den_times: Sequence[float],
                    den_reached: Sequence[bool], n_resamples: int = 4000, seed: int = 0) -> dict:
    """Ratio of Kaplan-Meier medians ``num / den`` (e.g. TRL's time over tba's: how many times sooner tba is)
    with a paired percentile-bootstrap 95% interval: seeds are resampled as pairs, since run i of both
    methods shares seed i, prompts and eval problems.

    Returns:
        ``{"ratio", "low", "high", "n"}``; a resample's ratio is ``inf`` where only the numerator's median is
        not reached, 0 where only the denominator's, NaN where neither is (so a bound can be inf: the
        interval is open on that side).

    Raises:
        ValueError: the two methods have different numbers of runs.
    """
    if len(num_times) != len(den_times):
        raise ValueError(f"paired runs differ in number: {len(num_times)} vs {len(den_times)}")
    data = (np.asarray(num_times, float), np.asarray(num_reached, bool), np.asarray(den_times, float),
            np.asarray(den_reached, bool))

    def ratio(nt, nr, dt, dr, axis=-1):
        a, b = km_median(nt, nr), km_median(dt, dr)
        if math.isinf(b):
            return math.nan if math.isinf(a) else 0.0
        return a / b

    point = ratio(*data)
    if len(num_times) < 2:
        return {"ratio": point, "low": math.nan, "high": math.nan, "n": len(num_times)}
    with warnings.catch_warnings():
        # scipy also computes the resamples' standard error, which is inf - inf when some are unbounded
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.bootstrap(data, ratio, paired=True, vectorized=False, n_resamples=n_resamples,
                              confidence_level=0.95, method="percentile", random_state=np.random.default_rng(seed))
    low, high = res.confidence_interval
    return {"ratio": point, "low": float(low), "high": float(high), "n": len(num_times)}


def mean_ci(values: Sequence[float]) -> dict:
    """Mean with its 95% Student-t interval (runs are independent seeds).

    Returns:
        ``{"mean", "low", "high", "n"}``; the bounds are NaN for fewer than 2 values.
    """
    x = np.asarray(values, dtype=float)
    mean = float(x.mean()) if len(x) else math.nan
    if len(x) < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": len(x)}
    low, high = stats.t.interval(0.95, len(x) - 1, loc=mean, scale=stats.sem(x)) if x.std() > 0 else (mean, mean)
    return {"mean": mean, "low": float(low), "high": float(high), "n": len(x)}


def paired_difference_ci(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean of the paired differences ``a - b`` (same seed in both) with its 95% Student-t interval."""
    if len(a) != len(b):
        raise ValueError(f"paired runs differ in number: {len(a)} vs {len(b)}")
    return mean_ci(np.asarray(a, float) - np.asarray(b, float))


def sd_ratio_ci(sd_a: float, n_a: int, sd_b: float, n_b: int) -> dict:
    """Ratio ``sd_a / sd_b`` of two sample standard deviations (of ``n_a`` and ``n_b`` independent values from
    normal distributions) with its 95% interval from Fisher's F: the variance ratio r^2 lies in
    [r^2 / F(0.975; n_a - 1, n_b - 1), r^2 x F(0.975; n_b - 1, n_a - 1)]; the bounds are its square roots.

    Returns:
        ``{"mean", "low", "high", "n"}`` (``mean``: the ratio; ``n``: ``(n_a, n_b)``); NaN bounds when either
        side has fewer than 2 values, and an infinite ratio when ``sd_b`` is 0.

    Raises:
        ValueError: a negative standard deviation.
    """
    if sd_a < 0 or sd_b < 0:
        raise ValueError(f"standard deviations must be >= 0, got {sd_a} and {sd_b}")
    r = sd_a / sd_b if sd_b > 0 else math.inf
    if min(n_a, n_b) < 2:
        return {"mean": r, "low": math.nan, "high": math.nan, "n": (n_a, n_b)}
    f_low, f_high = stats.f.ppf(0.975, n_a - 1, n_b - 1), stats.f.ppf(0.975, n_b - 1, n_a - 1)
    return {"mean": r, "low": r / math.sqrt(f_low), "high": r * math.sqrt(f_high), "n": (n_a, n_b)}
