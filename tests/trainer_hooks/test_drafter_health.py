import pytest

from tailspec.trainer_hooks.drafter_health import DrafterHealth


def test_health_is_the_share_of_the_best_gain_and_warns_once_per_episode(caplog):
    health = DrafterHealth(floor=0.5)
    with caplog.at_level("WARNING", logger="tailspec.trainer_hooks.drafter_health"):
        assert health.update(4.0, model_drafter_steps=30, adaptive=False) == 1.0
        assert health.update(3.1, model_drafter_steps=30, adaptive=False) == pytest.approx(0.7)
        assert not caplog.records
        assert health.update(1.3, 30, False) == pytest.approx(0.1)  # weights dropped on a sync, say
        assert health.update(1.2, 30, False) == pytest.approx(0.2 / 3)
        assert len(caplog.records) == 1 and "fell to 1.30 from a best of 4.00" in caplog.text
        health.update(3.9, 30, False)  # recovered: a later fall warns again
        health.update(1.1, 30, False)
    assert len(caplog.records) == 2 and health.best == 4.0 and len(health.scores) == 6


def test_adaptive_that_ran_no_drafting_arm_scores_zero_and_says_so(caplog):
    health = DrafterHealth()
    with caplog.at_level("WARNING", logger="tailspec.trainer_hooks.drafter_health"):
        health.update(3.0, 12, adaptive=True)
        assert health.update(1.0, 0, adaptive=True) == 0.0
    assert "ran none of its model-drafter arms" in caplog.text
    plain = DrafterHealth()
    with caplog.at_level("WARNING", logger="tailspec.trainer_hooks.drafter_health"):
        caplog.clear()
        assert plain.update(1.0, 0, adaptive=False) == 0.0  # a fixed model-free strategy: nothing to say
    assert not caplog.records


def test_the_floor_is_checked():
    with pytest.raises(ValueError, match="floor must be in"):
        DrafterHealth(floor=1.5)


def test_a_drafter_that_does_not_fit_the_synced_policy_scores_zero_and_says_what_to_check(caplog):
    health = DrafterHealth()
    health.update(4.0, 30, adaptive=True)
    with caplog.at_level("WARNING", logger="tailspec.trainer_hooks.drafter_health"):
        health.fit(["drafter vocabulary size 512 does not match the target's 520"])
        assert health.update(1.0, 0, adaptive=True) == 0.0
        assert health.update(1.0, 0, adaptive=True) == 0.0  # the same episode: no second warning
    assert len(caplog.records) == 1
    assert "does not fit the policy synced" in caplog.text and "512" in caplog.text and "resize" in caplog.text
    health.fit([])
    assert health.update(4.0, 30, adaptive=True) == 1.0
