from tailspec.benchmarks.eagle3 import eagle3_table, measure_eagle3, plot_eagle3
from tailspec.rollout import SamplingParams
from tailspec.testing import perturbed_copy, tiny_random_model


def test_measure_and_report_eagle3(tmp_path):
    model = tiny_random_model("qwen2", seed=1)
    drafter_lm = perturbed_copy(model, noise=0.1, seed=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    bench = measure_eagle3(
        model, drafter_lm, prompts, prompts[:2], [[3, 4]], params, [1], rounds=2, steps_per_round=3, seed=0
    )
    assert bench.train_steps == 6 and len(bench.losses) == 6 and len(bench.rounds) == 2
    assert [r.strategy for r in bench.after] == ["none", "chain:5", "tree:4,2,8"]
    assert all(r.completion_tokens > 0 for r in bench.before + bench.after + bench.small_lm)
    table = eagle3_table(bench)
    assert "after 6 steps" in table and table.count("\n") == 1 + 1 + 1 + 2 + 1
    plot_eagle3(bench, tmp_path / "eagle3.png")
    assert (tmp_path / "eagle3.png").stat().st_size > 0
