import math
import random

import pytest

from tailspec.atts import ConformalCalibration, NeverTakeover, OnlineConformal, SplitConformal, binomial_interval


def test_threshold_is_the_finite_sample_quantile():
    cal = ConformalCalibration.from_scores([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0])  # n = 9
    # rank ceil(10 * 0.8) = 8 -> the 8th smallest
    assert cal.threshold(0.2) == 8.0
    assert cal.threshold(0.5) == 5.0
    assert cal.threshold(0.05) == math.inf  # (n + 1) alpha < 1: never take over
    assert cal.guaranteed_rate(0.2) == pytest.approx(0.2)
    assert cal.guaranteed_rate(0.25) == pytest.approx(0.2)


def test_p_value_and_threshold_agree():
    rng = random.Random(0)
    cal = ConformalCalibration.from_scores(rng.random() for _ in range(57))
    for alpha in (0.05, 0.1, 0.3, 0.5):
        q = cal.threshold(alpha)
        for _ in range(200):
            s = rng.random()
            assert (s > q) == (cal.p_value(s) <= alpha)


@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2, 0.4])
def test_split_conformal_takeover_rate_is_alpha_for_exchangeable_scores(alpha):
    """Fresh calibration set per decision: decisions are iid Bernoulli(floor((n+1) alpha)/(n+1))."""
    rng = random.Random(int(alpha * 1000))
    n, trials = 99, 2000
    takeovers = 0
    for _ in range(trials):
        cal = ConformalCalibration.from_scores(rng.gauss(0, 1) for _ in range(n))
        takeovers += SplitConformal(cal, alpha).decide(rng.gauss(0, 1)).takeover
    rate = math.floor((n + 1) * alpha) / (n + 1)
    lo, hi = binomial_interval(trials, rate, level=0.999)
    assert lo <= takeovers <= hi, (takeovers, lo, hi)


def test_a_shifted_test_distribution_is_taken_over_more():
    rng = random.Random(1)
    cal = ConformalCalibration.from_scores(rng.gauss(0, 1) for _ in range(500))
    policy = SplitConformal(cal, 0.1)
    rate = sum(policy.decide(rng.gauss(1.0, 1)).takeover for _ in range(1000)) / 1000
    assert rate > 0.25


def test_online_variant_tracks_alpha_under_drift():
    rng = random.Random(2)
    cal = ConformalCalibration.from_scores(rng.gauss(0, 1) for _ in range(500))
    split, online = SplitConformal(cal, 0.2), OnlineConformal(cal, 0.2, step=0.02)
    scores = [rng.gauss(0.8, 1) for _ in range(3000)]  # drifted: split over-takes
    split_rate = sum(split.decide(s).takeover for s in scores) / len(scores)
    online_rate = sum(online.decide(s).takeover for s in scores) / len(scores)
    assert split_rate > 0.35
    assert abs(online_rate - 0.2) < 0.02


def test_never_takeover():
    assert not NeverTakeover().decide(1e9).takeover


@pytest.mark.parametrize("alpha", [0, 1, -0.1, 1.5, True, "0.1"])
def test_alpha_outside_the_open_unit_interval_is_refused(alpha):
    cal = ConformalCalibration.from_scores([1.0, 2.0])
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
        SplitConformal(cal, alpha)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
        cal.threshold(alpha)


def test_empty_or_non_finite_calibration_is_refused():
    with pytest.raises(ValueError, match="calibration set is empty"):
        ConformalCalibration.from_scores([])
    with pytest.raises(ValueError, match="finite"):
        ConformalCalibration.from_scores([1.0, float("nan")])


def test_binomial_interval_covers_the_mass():
    lo, hi = binomial_interval(100, 0.3, level=0.95)
    assert 20 <= lo <= 22 and 38 <= hi <= 40
    assert binomial_interval(10, 0.0) == (0, 0)
