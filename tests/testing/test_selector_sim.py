"""The selector simulator's regimes, judged by issue 46's targets (the minimum over seeds; the bench
section, docs/BENCHMARKS.md, runs 5 seeds of each)."""

import pytest

from tailspec.testing.selector_sim import REGIMES, judge, simulate, worst_case


@pytest.mark.parametrize("regime, seeds", [("gpu", 3), ("gpu_host", 2), ("cpu", 2), ("crossover", 3)])
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


def test_a_drafting_cost_that_moves_is_followed_within_a_rollout():
    """Run 14's long tail (docs/GPU.md): drafting cost ~2.3x what the greedy batches before it
    taught, and adaptive reached 0.81 of chain:4. Here drafting triples from the fourth rollout
    on: after the rollout that learns it, adaptive keeps up with the arm best on the new costs.
    The selector before this (one correction of the whole step, window medians only) reached
    0.892 on seed 1, counting the drafting's change twice."""
    for seed in range(3):
        results = simulate("shifting", seed)
        fixed = [c for c in results.values() if c.arm is not None]
        settled = min(sum(c.seconds[4:]) for c in fixed) / sum(results["adaptive"].seconds[4:])
        assert settled >= 0.92, (seed, settled)
        v = judge(results, "shifting", seed)
        assert v.vs_best_fixed >= 0.97 and v.vs_oracle <= 1.07, v


def test_every_contender_generates_the_same_rollouts():
    results = simulate("gpu", 0, rl_steps=2)
    assert set(results) == {"none", "chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid:4,2,12", "adaptive", "oracle"}
    assert all(len(c.seconds) == 2 and all(s > 0 for s in c.seconds) for c in results.values())
    assert sum(results["none"].seconds) > sum(results["chain:4"].seconds)  # drafting pays on this GPU
    assert set(REGIMES) == {"gpu", "gpu_host", "cpu", "crossover", "noisy", "drifting", "shifting"}
