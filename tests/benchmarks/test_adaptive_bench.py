import pytest

from tailspec.benchmarks.adaptive import (
    RunResult,
    bucket_weighted,
    long_tail_table,
    measure_long_tail,
    measure_uniform,
    oracle_bound,
    plot_adaptive,
    same_pass_ratios,
    same_pass_table,
)
from tailspec.rollout import SamplingParams
from tailspec.rollout.engine import StepRecord
from tailspec.testing import perturbed_copy, tiny_random_model


def test_measure_and_report_long_tail(tmp_path):
    model = tiny_random_model("qwen2", seed=1)
    drafter = perturbed_copy(model, noise=0.1, seed=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, noise="position", seed=0)
    results = measure_long_tail(model, drafter, prompts, params, [1], 0, fixed=("chain:2", "suffix"), repeats=2)
    names = [r.name for r in results]
    assert names == ["HF generate", "none", "chain:2", "suffix", "adaptive (cold)", "adaptive (warm)"]
    assert all(r.tokens > 0 and r.seconds > 0 for r in results)
    # position-keyed noise: every engine emits the same completions on the same rounds' workloads
    engines = [r for r in results if r.name not in ("HF generate", "adaptive (cold)")]
    assert len({r.tokens for r in engines}) == 1 and all(len(r.pass_seconds) == 2 for r in engines)
    ratios = same_pass_ratios(results, "adaptive (warm)", "chain:2")
    by = {r.name: r for r in results}
    assert ratios == [b / a for a, b in zip(by["adaptive (warm)"].pass_seconds, by["chain:2"].pass_seconds)]
    paired = same_pass_table(results)
    assert "| chain:2" in paired and "| suffix" in paired and paired.count("(best fixed)") == 1
    adaptive = results[-1]
    assert adaptive.steps and sum(adaptive.strategy_steps.values()) >= len(adaptive.steps)  # steps: the last pass
    table = long_tail_table(results)
    assert "(best fixed)" in table and table.count("\n") == 1 + len(results)
    oracle = oracle_bound(results, (1, 2, 4, 1024), min_steps=1)
    assert oracle.oracle_decode_s <= oracle.none_decode_s and oracle.speedup >= 1.0
    assert "`none` tok/s" in oracle.table and "`adaptive (warm)` tok/s" in oracle.table
    weighted = bucket_weighted(results, (1, 2, 4, 1024))
    assert set(weighted) == set(names) - {"HF generate"}
    assert weighted["none"] == pytest.approx(sum(s.seconds for s in results[1].all_steps))
    plot_adaptive(adaptive, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
    uniform = measure_uniform(model, drafter, prompts, params, [1], repeats=2)
    assert [r.tokens for r in uniform] == [16 * len(prompts) * 2, 16 * len(prompts), 16 * len(prompts) * 2]


def test_the_oracle_bound():
    def step(active, arm, emitted, seconds):
        return StepRecord(active, arm, emitted, seconds, in_tail=False)

    bounds = (1, 4, 16)
    none = RunResult("none", 0, 0, all_steps=[step(1, "none", 10, 1.0)] * 5 + [step(8, "none", 80, 1.0)] * 5)
    chain = RunResult("chain:2", 0, 0, all_steps=[step(1, "chain:2", 20, 1.0)] * 5 + [step(8, "chain:2", 40, 1.0)] * 5)
    few = RunResult("tree", 0, 0, all_steps=[step(1, "tree", 100, 1.0)] * 4)  # 4 steps: not trusted
    oracle = oracle_bound([none, chain, few], bounds)
    # bucket 1: chain:2 at 20 tok/s decodes none's 50 tokens in 2.5 s; bucket 16: none stays best (5 s)
    assert oracle.none_decode_s == 10.0 and oracle.oracle_decode_s == 7.5
    assert oracle.speedup == 10.0 / 7.5
    assert "| 1 | 5.00 | 10 | 20 | 100 | `chain:2` |" in oracle.table
    assert "| >4 | 5.00 | 80 | 40 | - | `none` |" in oracle.table
    # weighted by none's tokens per bucket: chain:2 takes 2.5 s in bucket 1 and 400 / 40 = 10 s in
    # the last; "tree" never reached the last bucket, which counts at none's 5 s there
    weighted = bucket_weighted([none, chain, few], bounds)
    assert weighted == {"none": 10.0, "chain:2": 12.5, "tree": 0.5 + 5.0}
