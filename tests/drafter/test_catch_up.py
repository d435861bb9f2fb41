"""Catch-up: drafter training runs at a higher learning rate while the accept length has fallen far
below its recent best, and only then."""

import pytest

from tailspec.drafter.catch_up import CatchUp, CatchUpConfig


def test_a_sudden_fall_scales_the_learning_rate_until_the_drafter_is_back():
    rule = CatchUp(CatchUpConfig(below=0.8, lr_scale=10.0, decay=0.97))
    for accept in [3.3, 3.5, 3.2, 3.4, 3.1]:  # ordinary noise: never behind
        assert rule.observe(accept, drafted_tokens=100) == 1.0
    assert rule.observe(1.2, drafted_tokens=100) == 10.0  # the policy changed its format
    assert rule.observe(1.9, drafted_tokens=100) == 10.0
    assert rule.observe(3.0, drafted_tokens=100) == 1.0  # back above 0.8 x the (decayed) reference
    assert rule.rollouts_caught_up == 2


def test_the_reference_forgets_a_level_no_longer_reached():
    rule = CatchUp(CatchUpConfig(below=0.8, decay=0.9))
    rule.observe(4.0, drafted_tokens=1)
    scales = [rule.observe(2.5, drafted_tokens=1) for _ in range(8)]
    assert scales[0] > 1.0 and scales[-1] == 1.0  # a new, lower level stops counting as behind


def test_rollouts_without_drafts_and_the_off_switch_change_nothing():
    rule = CatchUp()
    rule.observe(3.0, drafted_tokens=10)
    assert rule.observe(1.0, drafted_tokens=0) == 1.0 and rule.reference == 3.0
    off = CatchUp(CatchUpConfig(below=0.0))
    off.observe(3.0, drafted_tokens=10)
    assert off.observe(1.1, drafted_tokens=10) == 1.0


def test_state_round_trips():
    rule = CatchUp()
    for a in [3.0, 1.0]:
        rule.observe(a, drafted_tokens=5)
    again = CatchUp()
    again.load_state_dict(rule.state_dict())
    assert again.state_dict() == rule.state_dict() and again.lr_scale == 10.0
    again.load_state_dict(None)  # a checkpoint from before catch-up: nothing to load
    assert again.reference == rule.reference


@pytest.mark.parametrize(
    "field,value", [("below", 1.0), ("below", -0.1), ("lr_scale", 0.5), ("lr_scale", float("inf")), ("decay", 0.0)]
)
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        CatchUpConfig(**{field: value})
