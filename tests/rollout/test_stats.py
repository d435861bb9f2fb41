"""EngineCounts: the one record from an engine to the trainer's logs. A span's counts are ``after -
before``; workers' counts sum with ``+``; the derived rates come from the summed counts."""

from dataclasses import fields

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.stats import EngineCounts, EngineStats
from tailspec.testing import perturbed_copy, tiny_random_model


def test_a_span_of_work_is_after_minus_before_and_spans_add_up():
    model = tiny_random_model("qwen2", seed=1)
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:2"), drafter=perturbed_copy(model, noise=0.3, seed=7))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    start = engine.stats.counts()
    engine.generate([[5, 6, 7], [8, 9]], params)
    middle = engine.stats.counts()
    engine.generate([[3, 4]], params)
    first, second = middle - start, engine.stats.counts() - middle
    assert first.generated_tokens == 24 and second.generated_tokens == 12
    assert (first + second).generated_tokens == engine.stats.generated_tokens
    assert (first + second).strategy_steps == engine.stats.strategy_steps
    assert first.mean_accept_length == first.spec_emitted_tokens / first.spec_seq_steps > 1.0
    assert type(middle) is EngineCounts and not hasattr(middle, "step_log")  # the counts alone
    middle.strategy_steps["chain:2"] += 100  # a copy: the engine's own counts are untouched
    assert engine.stats.strategy_steps["chain:2"] < 100


def test_the_engines_stats_are_its_counts_plus_its_logs():
    counts = {f.name for f in fields(EngineCounts)}
    assert counts < {f.name for f in fields(EngineStats)}
    assert {f.name for f in fields(EngineStats)} - counts == {"batch_sizes", "spec_log", "step_log"}
    empty = EngineCounts()
    assert (empty + empty) == empty and empty.mean_accept_length == 1.0 and empty.acceptance_rate == 0.0
    assert (EngineCounts(strategy_steps={"none": 3}) - EngineCounts(strategy_steps={"none": 3})).strategy_steps == {}
