"""Calibration: the forward table timed on scratch KV blocks, within what the cache holds, and
what a cached token costs."""

from rollout_helpers import cached_model, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.adaptive.calibration import CONTEXT, scratch_fit
from tailspec.testing import perturbed_copy


def test_scratch_fit_keeps_calibration_within_the_free_blocks():
    assert scratch_fit(100, 16, 4, 1) == (4, 128)  # room for all at the usual context
    assert scratch_fit(12, 16, 4, 1) == (4, 47)  # 3 blocks each: a shorter context
    assert scratch_fit(3, 16, 4, 1) == (3, 15)  # one block each, for 3 of the 4
    assert scratch_fit(0, 16, 4, 1) == (0, 0)
    for free, n, width in [(7, 3, 5), (40, 8, 9), (1, 1, 16), (9, 2, 33)]:
        batch, context = scratch_fit(free, 16, n, width)
        assert batch * -(-(context + width) // 16) <= free


def test_adaptive_calibrates_on_a_kv_cache_too_small_for_its_scratch_context():
    """A cache too small for calibration's scratch sequences at its usual context: target and
    drafter are timed on fewer sequences or a shorter context (the drafter's level scaled to the
    batch), never out of blocks, and the rollout stays lossless."""
    model = cached_model("llama")
    config = RolloutConfig(strategy="adaptive", max_num_seqs=2, kv_cache_tokens=96, block_size=16)  # 6 blocks
    engine = RolloutEngine(model, config, eos_token_ids=[], drafter=perturbed_copy(model, 0.3, 7))
    prompts = [[3 + i, 5, 7, 11] for i in range(2)]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    out = engine.generate(prompts, params)
    costs = engine.selector.costs
    assert costs is not None and len(costs.draft["model"].pooled.logs) >= 1  # the drafter's level was timed
    plain = RolloutEngine(model, RolloutConfig(strategy="none", max_num_seqs=2, kv_cache_tokens=96), eos_token_ids=[])
    assert [o.completion_ids for o in out] == [o.completion_ids for o in plain.generate(prompts, params)]


def test_calibration_times_what_a_cached_token_costs_at_the_narrowest_and_widest_width():
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, 0.3, 7))
    engine.choice.calibrate(4, fresh=True)
    table = engine.selector.costs.table
    widths = sorted({t for _, t in table.measured})
    assert table.context == CONTEXT and sorted(table.per_token) == [widths[0], widths[-1]]
    assert all(v >= 0 for v in table.per_token.values())
    engine.choice.calibrate(8, fresh=False)  # extended to a larger batch: the slopes are kept
    assert engine.selector.costs.table.per_token == table.per_token


def test_an_extended_table_keeps_its_slopes_when_this_process_timed_the_shapes_before():
    """Another engine of the same model timed the extended shapes first: what this table measured
    stays, not the other engine's timings (a test run in one process with another did that)."""
    model = cached_model("llama")
    other = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, 0.3, 7))
    other.choice.calibrate(8, fresh=True)
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, 0.3, 7))
    engine.choice.calibrate(4, fresh=True)
    table = engine.selector.costs.table
    engine.choice.calibrate(8, fresh=False)
    extended = engine.selector.costs.table
    assert extended.per_token == table.per_token
    assert all(extended.measured[s] == v for s, v in table.measured.items())


def test_adaptive_prices_each_step_at_its_sequences_mean_context(monkeypatch):
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=perturbed_copy(model, 0.3, 7))
    means, asked = [], []
    plan, choose = engine.meter.plan, engine.selector.choose

    def planned(seqs, *rest):
        means.append(sum(s.num_tokens for s in seqs) / len(seqs))
        return plan(seqs, *rest)

    def chosen(n, remaining=None, lag_tokens=0, context=None):
        asked.append(context)
        return choose(n, remaining, lag_tokens, context)

    monkeypatch.setattr(engine.meter, "plan", planned)
    monkeypatch.setattr(engine.selector, "choose", chosen)
    engine.generate(random_prompts(3, seed=5), SamplingParams(max_new_tokens=24, temperature=0.0))
    assert asked and asked == means  # each step priced at its batch's mean length
    assert asked[-1] > asked[0]  # which grows as the rollout goes on
