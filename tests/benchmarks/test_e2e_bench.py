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


def test_turns_alternate_and_survive_a_finished_or_failed_trainer():
    import threading

    from tailspec.benchmarks.e2e import _Turns

    turns, order = _Turns(2), []

    def worker(i: int, steps: int, fail_at: int | None = None) -> None:
        try:
            for k in range(steps):
                turns.wait(i)
                order.append(i)
                if k == fail_at:
                    raise RuntimeError("a trainer died mid-step")
                turns.pass_on(i)
        except RuntimeError:
            pass
        finally:
            turns.pass_on(i, finished=True)

    threads = [threading.Thread(target=worker, args=(0, 2, 1)), threading.Thread(target=worker, args=(1, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)  # no deadlock when trainer 0 dies holding the turn
    assert order == [0, 1, 0, 1, 1, 1]
