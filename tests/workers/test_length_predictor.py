"""Length prediction from siblings finished in this rollout and from earlier rollouts' lengths."""

import math

import pytest

from tailspec.workers.length_predictor import LengthPredictor


def test_siblings_then_history_predict_and_the_window_slides():
    p = LengthPredictor(window=2)
    assert p.predict([1, 2]) is None
    p.observe([1, 2], 10)
    p.observe([1, 2], 30)
    assert p.predict([1, 2]) == 20 and p.siblings_seen([1, 2]) == 2
    for lengths in ([100], [200], [300]):
        p.begin_rollout()
        for n in lengths:
            p.observe([1, 2], n)
    p.begin_rollout()
    assert p.predict([1, 2]) == 250  # the last two rollouts only
    assert p.siblings_seen([1, 2]) == 0


def test_errors_are_logged_per_rollout():
    p = LengthPredictor()
    p.observe([3], 100, predicted=None)  # no prediction: not scored
    p.observe([3], 100, predicted=50.0)
    p.observe([4], 10, predicted=20.0)
    assert p.log.mean_rel_error == pytest.approx((0.5 + 1.0) / 2)
    assert p.log.rank_agreement() == 1.0
    p.begin_rollout()
    assert math.isnan(p.log.mean_rel_error)


def test_state_round_trips():
    p = LengthPredictor(window=3)
    p.observe([5], 7)
    p.begin_rollout()
    q = LengthPredictor()
    q.load_state_dict(p.state_dict())
    assert q.predict([5]) == 7 and q.window == 3
    with pytest.raises(ValueError, match="window"):
        LengthPredictor(window=-1)
