from tailspec.benchmarks.adaptive import long_tail_table, measure_long_tail, measure_uniform, plot_adaptive
from tailspec.rollout import SamplingParams
from tailspec.testing import perturbed_copy, tiny_random_model


def test_measure_and_report_long_tail(tmp_path):
    model = tiny_random_model("qwen2", seed=1)
    drafter = perturbed_copy(model, noise=0.1, seed=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    results = measure_long_tail(model, drafter, prompts, params, [1], 0, fixed=("chain:2", "suffix"), repeats=2)
    names = [r.name for r in results]
    assert names == ["HF generate", "none", "chain:2", "suffix", "adaptive (cold)", "adaptive (warm)"]
    assert all(r.tokens > 0 and r.seconds > 0 for r in results)
    adaptive = results[-1]
    assert adaptive.steps and sum(adaptive.strategy_steps.values()) >= len(adaptive.steps)  # steps: the last pass
    table = long_tail_table(results)
    assert "(best fixed)" in table and table.count("\n") == 1 + len(results)
    plot_adaptive(adaptive, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
    uniform = measure_uniform(model, drafter, prompts, params, [1], repeats=2)
    assert [r.tokens for r in uniform] == [16 * len(prompts) * 2, 16 * len(prompts), 16 * len(prompts) * 2]
