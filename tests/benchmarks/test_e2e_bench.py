"""The end-to-end GRPO comparison: both trainers run, are timed per step, and the report holds
the per-step speedup and the reward test."""

import os

from tailspec.benchmarks.e2e import E2ERun, e2e_table, measure_e2e, permutation_pvalue, plot_e2e

os.environ.setdefault("WANDB_MODE", "disabled")


def test_permutation_test_separates_different_means():
    same = [0.1, 0.3, 0.2, 0.4, 0.25]
    assert permutation_pvalue(same, list(same)) == 1.0
    assert permutation_pvalue([0.0] * 8, [1.0] * 8, rounds=2000) < 0.01


def test_quick_end_to_end_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the trainers' output_dir
    runs = measure_e2e(2, quick=True)
    assert [r.name.split()[0] for r in runs] == ["stock", "tailspec"]
    for r in runs:
        assert len(r.step_s) == 2 and len(r.rewards) == 2 and r.total_s > 0
        assert len(r.generation_s) == 2 and all(0 < g < s for g, s in zip(r.generation_s, r.step_s))
    table = e2e_table(runs)
    assert "1.00x" in table and "permutation test" in table
    plot_e2e(runs, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 0
    run = E2ERun("x", [5.0, 1.0, 3.0], [0.0], 9.0, [4.0, 0.5, 1.5])
    assert run.mean_step_s() == 2.0 and run.mean_generation_s() == 1.0
