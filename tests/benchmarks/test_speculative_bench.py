from tailspec.benchmarks.speculative import measure_speculative, plot_speculative, speculative_table
from tailspec.rollout import SamplingParams
from tailspec.testing import perturbed_copy, tiny_random_model


def test_measure_and_report_speculative(tmp_path):
    model = tiny_random_model("qwen2", seed=1)
    drafter = perturbed_copy(model, noise=0.1, seed=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    results = measure_speculative(
        model, drafter, prompts, [[3, 4]], params, (1, 2), ("none", "chain:3"), {1: 2, 2: 4}, [1], group_size=2
    )
    assert [(r.batch_size, r.strategy) for r in results] == [(1, "none"), (1, "chain:3"), (2, "none"), (2, "chain:3")]
    for r in results:
        assert r.completion_tokens == 12 * r.num_prompts
        assert r.tokens_per_s > 0
    spec = [r for r in results if r.strategy != "none"]
    assert all(r.mean_accept_length > 1.0 and 0 < r.acceptance_rate <= 1 for r in spec)
    table = speculative_table(results)
    assert table.count("\n") == 1 + len(results) and "x |" in table
    plot_speculative(results, tmp_path / "spec.png")
    assert (tmp_path / "spec.png").stat().st_size > 0
