"""The selector simulator's regimes, judged by issue 46's targets (the minimum over seeds)."""

import pytest

from tailspec.testing.selector_sim import REGIMES, simulate, worst_case


@pytest.mark.parametrize("regime, seeds", [("gpu", 5), ("gpu_host", 2), ("cpu", 2), ("crossover", 3)])
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
def test_heavy_noise_and_a_drifting_drafter(regime):
    """Heavy noise: the calibration itself is noisy (forward timings 25% apart); the monotone table
    and the per-arm corrections keep adaptive near the best fixed arm. The bench section runs all 5
    seeds (docs/BENCHMARKS.md, the selector simulator); 3 here keep the suite short."""
    for v in worst_case(regime, range(3)):
        assert v.vs_best_fixed >= 0.95 and v.first_vs_best_fixed >= 0.9, v
        assert v.vs_oracle <= 1.06 and v.off_first < 0.05, v


def test_every_contender_generates_the_same_rollouts():
    results = simulate("gpu", 0, rl_steps=2)
    assert set(results) == {"none", "chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid:4,2,12", "adaptive", "oracle"}
    assert all(len(c.seconds) == 2 and all(s > 0 for s in c.seconds) for c in results.values())
    assert sum(results["none"].seconds) > sum(results["chain:4"].seconds)  # drafting pays on this GPU
    assert set(REGIMES) == {"gpu", "gpu_host", "cpu", "crossover", "noisy", "drifting"}
