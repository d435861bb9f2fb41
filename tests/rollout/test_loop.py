"""The engine's one loop: each step is launched before the step before it is committed
(rollout/launched.py, rollout/sampled.py). Its tokens are the ones a step launched from the host's
tokens gives (every step committed first: ``generate_committing_each_step``), and HF's at greedy;
only the order of work differs."""

from dataclasses import replace

import pytest
import torch
from rollout_helpers import (
    EOS,
    chi_square_pvalue,
    generate_committing_each_step,
    hf_greedy,
    random_prompts,
    serve_handing_one_over,
)
from test_spec_sampling import PROMPT, V, exact_joint_of_tokens_2_and_3, target

from tailspec.kernels.transfers import QueuedRead
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.runner import ModelRunner
from tailspec.testing import perturbed_copy, stopping_params, with_synchronizations


def _completions(model, prompts, params, committed: bool = False, **config):
    """The outputs and engine of a run (``committed``: every step committed before the next)."""
    engine = RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=4096, **config), eos_token_ids=[EOS])
    outs = generate_committing_each_step(engine, prompts, params) if committed else engine.generate(prompts, params)
    assert not engine.has_unfinished() and engine.in_flight is None  # nothing left in flight after a call
    return outs, engine


def test_launched_greedy_decoding_equals_committed_steps_and_hf(arch_model):
    prompts = random_prompts(7, seed=31, min_len=2, max_len=14)
    params = stopping_params(arch_model, prompts)
    plain, _ = _completions(arch_model, prompts, params, committed=True)
    launched, engine = _completions(arch_model, prompts, params)
    assert [o.completion_ids for o in launched] == [o.completion_ids for o in plain]
    assert [o.finish_reason for o in launched] == [o.finish_reason for o in plain]
    for got, want in zip(launched, plain):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)  # other batch shapes: fp32 rounding
    stats = engine.stats
    assert stats.overlapped_steps == stats.decode_steps > 0
    assert stats.dropped_rows > 0  # rows of sequences that had stopped were computed and dropped
    assert stats.generated_tokens == sum(len(o.completion_ids) for o in launched)
    assert (
        launched[0].completion_ids
        == hf_greedy(arch_model, prompts[0], params[0].max_new_tokens, EOS)[: len(launched[0].completion_ids)]
    )


def test_admission_and_preemption_under_the_loop_stay_exact(arch_model):
    """Fewer slots than prompts (admissions mid-run) and a pool too small for all of them
    (preemptions): the step in flight is committed before anyone is preempted, and the tokens do
    not change."""
    prompts = random_prompts(8, seed=32, min_len=3, max_len=12)
    params = stopping_params(arch_model, prompts, n=24)
    small = {"max_num_seqs": 3, "num_blocks": 16}
    plain, plain_engine = _completions(arch_model, prompts, params, committed=True, **small)
    launched, engine = _completions(arch_model, prompts, params, **small)
    assert [o.completion_ids for o in launched] == [o.completion_ids for o in plain]
    assert plain_engine.stats.preemptions > 0 and engine.stats.preemptions > 0
    assert 0 < engine.stats.overlapped_steps < engine.stats.decode_steps + engine.stats.prefill_steps


def test_prefix_caching_under_the_loop_reuses_only_blocks_of_known_tokens(arch_model):
    """A turn's prompt extends the last turn's (multi-turn, ATTS): blocks that a launched step
    wrote for a row it dropped are registered under tokens that were read, so the next turn's
    reuse decodes as plain decoding with the same cache does."""
    prompts = random_prompts(5, seed=38, min_len=6, max_len=14)
    params = stopping_params(arch_model, prompts, n=22)

    def two_turns(committed: bool):
        engine = RolloutEngine(
            arch_model, RolloutConfig(block_size=4, kv_cache_tokens=4096, prefix_caching=True), eos_token_ids=[EOS]
        )
        run = (lambda p, q: generate_committing_each_step(engine, p, q)) if committed else engine.generate
        first = run(prompts, params)
        again = [p + o.completion_ids + [7, 8] for p, o in zip(prompts, first)]
        second = run(again, SamplingParams(temperature=0.0, max_new_tokens=10))
        return [o.completion_ids for o in first + second], engine.stats

    plain, _ = two_turns(True)
    launched, stats = two_turns(False)
    assert launched == plain
    assert stats.prefix_hit_tokens > 0 and stats.dropped_rows > 0


@pytest.mark.parametrize("noise", ["stream", "position"], ids=["seeded", "position-keyed"])
def test_the_loop_keeps_seeded_and_position_keyed_samples(arch_model, noise):
    prompts = random_prompts(6, seed=33, min_len=2, max_len=10)
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=50 + i, noise=noise, max_new_tokens=18, stop_token_ids=[3, 9])
        for i in range(len(prompts))
    ]
    plain, _ = _completions(arch_model, prompts, params, committed=True)
    launched, engine = _completions(arch_model, prompts, params)
    assert [o.completion_ids for o in launched] == [o.completion_ids for o in plain]
    for got, want in zip(launched, plain):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)  # other batch shapes: fp32 rounding
    assert engine.stats.overlapped_steps > 0


def test_launched_unseeded_samples_follow_the_target():
    """Unseeded rows draw from the engine's generator, dropped rows too (stopping requests share the
    batch): the draws after them differ from plain decoding's, their distribution does not."""
    n, stoppers = 4000, 400
    engine = RolloutEngine(
        target(),
        RolloutConfig(max_num_seqs=n + stoppers, block_size=4, kv_cache_tokens=(n + stoppers) * 12),
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    stopping = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=list(range(V // 2)))
    outs = engine.generate([PROMPT] * (n + stoppers), [params] * n + [stopping] * stoppers)
    assert engine.stats.dropped_rows > stoppers // 10
    pairs = torch.tensor([o.completion_ids[1] * V + o.completion_ids[2] for o in outs[:n]])
    assert chi_square_pvalue(torch.bincount(pairs, minlength=V * V), exact_joint_of_tokens_2_and_3(params)) > 1e-3


def test_a_step_is_read_only_after_the_next_one_is_launched(arch_model, monkeypatch):
    """What the loop is for: step N's tokens are waited for after step N + 1's forward is queued
    (on CUDA the host then works while the device computes). Recorded order of forwards and reads."""
    events: list[str] = []
    forward, result = ModelRunner.forward, QueuedRead.result

    def logged_forward(self, seqs, tokens, positions, logits_index):
        events.append("prefill" if any(s.num_new > 1 for s in seqs) else "decode")
        return forward(self, seqs, tokens, positions, logits_index)

    def logged_result(self):
        events.append("read")
        return result(self)

    monkeypatch.setattr(ModelRunner, "forward", logged_forward)
    monkeypatch.setattr(QueuedRead, "result", logged_result)
    prompts = random_prompts(3, seed=34, min_len=4, max_len=8)
    _completions(arch_model, prompts, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    # every step, the prefill too, is read after the next one is launched; the last decode (the
    # 6th token) takes no further step, so it is read with nothing launched
    assert events == ["prefill"] + ["decode", "read"] * 5 + ["read"]


def test_release_and_abort_commit_the_step_in_flight_first(arch_model):
    prompts = random_prompts(3, seed=35, min_len=3, max_len=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    plain, _ = _completions(arch_model, prompts, params, committed=True)
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=4096))
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(5):
        assert engine.step() == []
    assert engine.in_flight is not None
    partial = engine.release(ids[0])  # its token in flight belongs to what is handed over
    assert partial.output_ids == plain[0].completion_ids[: len(partial.output_ids)] and len(partial.output_ids) == 5
    engine.abort(ids[1])
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished == [ids[2]] and engine.pop_output(ids[2]).completion_ids == plain[2].completion_ids
    assert engine.pop_output(ids[1]).finish_reason == "abort"
    resumed = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=4096))
    rid = resumed.add_request(prompts[0], params, resume=partial)
    while resumed.has_unfinished():
        resumed.step()
    assert resumed.pop_output(rid).completion_ids == plain[0].completion_ids


def test_serving_an_inbox_matches_committed_steps(arch_model):
    """``serve`` (what Ray workers run): requests joining the running batch, one handed back
    mid-run and finished by another engine; every completion is the committed steps' and every
    block is free at the end."""
    prompts = random_prompts(8, seed=40, min_len=2, max_len=12)
    params = stopping_params(arch_model, prompts, n=20)
    plain, _ = _completions(arch_model, prompts, params, committed=True)
    config = RolloutConfig(block_size=4, kv_cache_tokens=4096)
    engine, other = (RolloutEngine(arch_model, config, eos_token_ids=[EOS]) for _ in range(2))
    got = serve_handing_one_over(engine, other, prompts, params, [len(o.completion_ids) for o in plain])
    assert engine.stats.overlapped_steps > 0
    assert [got[i].completion_ids for i in range(len(prompts))] == [o.completion_ids for o in plain]
    for e in (engine, other):
        assert e.runner.cache.allocator.num_free == e.runner.cache.allocator.num_blocks


def test_steps_drafted_from_the_host_s_text_commit_the_step_before_first(arch_model):
    """The suffix drafter drafts from the host's text: its steps commit the step before them (chains
    from the drafter LM are launched from the device's state: tests/rollout/spec/test_device_step.py)."""
    prompts = random_prompts(4, seed=36, min_len=3, max_len=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain, _ = _completions(arch_model, prompts, params)
    drafted, engine = _completions(arch_model, prompts, params, strategy="suffix")
    assert [o.completion_ids for o in drafted] == [o.completion_ids for o in plain]
    assert engine.stats.overlapped_steps == 0 and engine.stats.spec_steps > 0


def _scripted_adaptive(model, arms: list[str], drafter=None) -> tuple[RolloutEngine, list[dict]]:
    """An ``adaptive`` engine whose selector plans its arms of the kinds ``arms`` in turn, one per
    plan, and whose observations (arm, batch size, timed, lag) are recorded."""
    engine = RolloutEngine(
        model,
        RolloutConfig(strategy="adaptive", block_size=4, kv_cache_tokens=4096),
        eos_token_ids=[EOS],
        drafter=drafter,
    )
    seen: list[dict] = []
    plans = iter(range(10**6))
    by_kind = {arm.kind: arm for arm in engine.selector.arms}
    engine.selector.choose = lambda n, remaining, lag, context: by_kind[arms[next(plans) % len(arms)]]
    observe = engine.selector.observe

    def spy(arm, n, seconds, *rest, timed=True, **kwargs):
        lag = rest[3] if len(rest) > 3 else 0
        seen.append({"arm": str(arm), "n": n, "timed": timed, "lag": lag, "seconds": seconds})
        observe(arm, n, seconds, *rest, timed=timed, **kwargs)

    engine.selector.observe = spy
    return engine, seen


@pytest.mark.parametrize(
    "noise, arm",
    [("greedy", "suffix"), ("position-keyed", "suffix"), ("greedy", "chain")],
    ids=["suffix", "keyed", "lm"],
)
def test_adaptive_moves_between_plain_and_speculative_steps_exactly(arch_model, noise, arm):
    """``adaptive`` switching between ``none`` and a speculative arm (a model drafter's too, which
    catches up on the tokens plain steps emitted): plain steps and chains of the drafter LM are
    launched before the step before them is committed, a suffix step commits it first, and the
    tokens are the committed steps'. Every step is learned from, at its own cost."""
    prompts = random_prompts(7, seed=38, min_len=2, max_len=14)
    params = stopping_params(arch_model, prompts, n=24)
    if noise == "position-keyed":
        params = [replace(p, temperature=1.0, seed=50 + i, noise="position") for i, p in enumerate(params)]
    plain, _ = _completions(arch_model, prompts, params, committed=True)
    drafter = perturbed_copy(arch_model, 0.3, 7) if arm == "chain" else None
    engine, seen = _scripted_adaptive(arch_model, ["none", "none", arm, arm], drafter)
    outs = engine.generate(prompts, params)
    assert not engine.has_unfinished() and engine.in_flight is None
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]
    stats = engine.stats
    steps = {str(arm).split(":")[0]: count for arm, count in stats.strategy_steps.items()}
    assert steps["none"] > 0 and steps[arm] > 0 and stats.overlapped_steps > 0
    if arm == "suffix":  # a suffix step never runs beside the step before it
        assert stats.overlapped_steps <= steps["none"]
    assert stats.generated_tokens == sum(len(o.completion_ids) for o in outs)
    assert all(s["seconds"] > 0 for s in seen)
    if arm == "chain":  # after two plain steps, the drafter catches up on what the host has read
        lags = [c["lag"] for a, b, c in zip(seen, seen[1:], seen[2:]) if a["arm"] == b["arm"] == "none"]
        assert lags[1:] and all(lag > 0 for lag in lags[1:]), lags


def test_a_step_from_the_host_s_text_after_a_plain_one_drops_the_sequences_that_stopped_on_it(arch_model):
    """Every other sequence stops on its 3rd token, sampled by the 2nd decode step (not committed
    when the 3rd is planned); the 3rd step, a suffix step, commits it first and runs without them."""
    prompts = random_prompts(4, seed=51, min_len=3, max_len=8)  # EOS nor the 3rd token among the first two
    free, _ = _completions(arch_model, prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[o.completion_ids[2]])
        if i % 2
        else SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        for i, o in enumerate(free)
    ]
    plain, _ = _completions(arch_model, prompts, params, committed=True)
    engine, seen = _scripted_adaptive(arch_model, ["none", "none", "suffix", "suffix"])
    sizes = []
    plan = engine.meter.plan
    engine.meter.plan = lambda seqs, *rest: sizes.append((engine.stats.steps, len(seqs))) or plan(seqs, *rest)
    outs = engine.generate(prompts, params)
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    stopped = sum(o.completion_ids[-1:] == [free[i].completion_ids[2]] for i, o in enumerate(outs) if i % 2)
    assert stopped == 2
    # step 0 prefills; steps 1 and 2 plan none; step 3 plans suffix for all 4, commits step 2's
    # tokens (2 sequences stopped) and runs the 2 left
    assert sizes[:3] == [(1, 4), (2, 4), (3, 4)]
    assert [(s["arm"].split(":")[0], s["n"]) for s in seen[:3]] == [("none", 4), ("none", 4), ("suffix", 2)]


def test_a_config_naming_overlap_is_refused_with_why():
    """Every step is launched before the one before it is committed: the field is gone, and a
    config that still names it says so."""
    from tailspec.config_tree import ConfigError, build

    with pytest.raises(ConfigError, match="overlap.*every decode step"):
        build(RolloutConfig, {"overlap": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_launched_steps_replay_graphs_exactly_and_never_wait_for_the_device():
    """Under CUDA graphs: the tokens of committed steps, and no call that waits for the device in a
    launched step (torch's sync debug mode flags them; the one wait for a step's tokens is on an
    event recorded after their copy, which it does not flag)."""
    from tailspec.testing import tiny_random_model

    model = tiny_random_model("llama", seed=1).cuda()
    prompts = random_prompts(5, seed=37, min_len=2, max_len=12)
    params = stopping_params(model, prompts, n=24)
    plain, _ = _completions(model, prompts, params, committed=True)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=4096), eos_token_ids=[EOS])
    engine.generate(prompts, params)  # captures every graph the measured call replays
    before = engine.stats.prefill_steps
    launched, waits = with_synchronizations(lambda: engine.generate(prompts, params))
    assert [o.completion_ids for o in launched] == [o.completion_ids for o in plain]
    assert engine.stats.overlapped_steps > 0 and waits <= engine.stats.prefill_steps - before, waits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_adaptive_moves_between_plain_steps_and_chains_under_graphs_exactly():
    """``adaptive`` switching between ``none`` steps and a model drafter's chains under CUDA graphs
    (the drafter's catch-up after plain steps included): the committed steps' tokens."""
    from tailspec.testing import tiny_random_model

    model = tiny_random_model("llama", seed=1).cuda()
    prompts = random_prompts(5, seed=38, min_len=2, max_len=12)
    params = stopping_params(model, prompts, n=24)
    plain, _ = _completions(model, prompts, params, committed=True)
    engine, seen = _scripted_adaptive(model, ["none", "none", "chain", "chain"], perturbed_copy(model, 0.3, 7))
    for _ in range(2):  # the first call captures
        outs = engine.generate(prompts, params)
        assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    assert engine.stats.overlapped_steps > 0 and any(s["arm"].startswith("chain") for s in seen)
    assert engine.runner.graph_pool is not None and engine.runner.graph_pool.stats.hits > 0


@pytest.mark.parametrize("strategy", ["none", "chain:3"])
def test_a_weight_update_mid_rollout_commits_the_step_in_flight_first(strategy):
    """New weights loaded into the policy while a step is in flight: ``weights_changed`` commits it
    (its tokens come from the weights it was launched with), and every later step runs the new
    weights, as when every step is committed before the next; a run without the update differs."""
    import copy

    from rollout_helpers import cached_model

    base = cached_model("llama")
    new_weights = perturbed_copy(base, 0.3, 9).state_dict()
    prompts = random_prompts(4, seed=52, min_len=3, max_len=10)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)

    def run(committed: bool, update: bool = True):
        model = copy.deepcopy(base)
        drafter = perturbed_copy(base, 0.05, 7) if strategy != "none" else None
        config = RolloutConfig(strategy=strategy, block_size=4, kv_cache_tokens=4096)
        engine = RolloutEngine(model, config, drafter=drafter, eos_token_ids=[EOS])
        ids = [engine.add_request(p, params) for p in prompts]
        for step in range(10**6):
            if step == 4 and update:
                assert engine.in_flight is not None and engine.in_flight.committed == committed
                with torch.no_grad():
                    model.load_state_dict(new_weights)
                engine.weights_changed()
                assert engine.in_flight.committed
            if not engine.has_unfinished():
                break
            engine.step()
            if committed:
                engine.sync()
        return [engine.pop_output(i).completion_ids for i in ids]

    got = run(committed=False)
    assert got == run(committed=True)
    assert got != run(committed=False, update=False)
