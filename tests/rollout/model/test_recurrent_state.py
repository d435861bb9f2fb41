"""Hybrid models (Gated DeltaNet beside attention: Qwen3.5 dense and MoE, Qwen3-Next): each running
sequence's recurrent state in a slot of its own, exact against transformers' own no-cache forward
under continuous batching, preemption, prompt groups, MIXED steps, abort and hand-over; what the
state cannot serve yet is refused by name."""

import pytest
import torch

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.recurrent_state import RecurrentStates
from tailspec.testing import random_prompts
from tailspec.testing.families import no_cache_greedy, no_cache_logprobs, tiny_family_model

HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    return tiny_family_model(request.param, seed=1)


def _want(model, prompts, new_tokens=12):
    return [no_cache_greedy(model, p, new_tokens, eos_id=-1) for p in prompts]


def _run(engine, prompts, params=GREEDY, each_step=None):
    ids = [engine.add_request(p, params) for p in prompts]
    step = 0
    while engine.has_unfinished():
        if each_step is not None:
            each_step(step, ids)
        engine.step()
        step += 1
    return [engine.pop_output(i) for i in ids]


def test_continuous_batching_decodes_transformers_tokens_and_logprobs(hybrid):
    """Five prompts of 1-20 tokens through three slots: sequences join as others finish, prefills and
    one-token steps from the state mix in the same forwards."""
    prompts = random_prompts(5, seed=3, min_len=1, max_len=20)
    engine = RolloutEngine(hybrid, RolloutConfig(max_num_seqs=3))
    outs = _run(engine, prompts)
    assert [o.completion_ids for o in outs] == _want(hybrid, prompts)
    for prompt, out in zip(prompts, outs):
        want = no_cache_logprobs(hybrid, prompt, out.completion_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
    assert engine.runner.states.num_free == 3  # every slot back
    assert engine.runner.states.bytes_per_slot() > 0


def test_preempted_sequences_recompute_their_state():
    model = tiny_family_model("qwen3_5_text", seed=2)
    prompts = random_prompts(4, seed=5, min_len=6, max_len=10)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=64, max_num_seqs=4))
    outs = _run(engine, prompts, params)
    assert engine.stats.preemptions > 0
    assert [o.completion_ids for o in outs] == _want(model, prompts, 20)


def test_a_prompt_group_s_members_start_from_their_leader_s_state():
    """Members of a group share the leader's prefill: its state is copied into their slots."""
    model = tiny_family_model("qwen3_next", seed=3)
    prompt = random_prompts(1, seed=9, min_len=7, max_len=7)[0]
    engine = RolloutEngine(model, RolloutConfig())
    outs = engine.generate([prompt] * 3, GREEDY)
    assert engine.stats.forked_prefills == 2
    assert all(o.completion_ids == _want(model, [prompt])[0] for o in outs)


def test_mixed_steps_keep_each_sequence_s_state_apart():
    model = tiny_family_model("qwen3_5_text", seed=4)
    prompts = random_prompts(5, seed=6, min_len=2, max_len=15)
    engine = RolloutEngine(model, RolloutConfig(mixed_batches=True))
    ids = []
    for prompt in prompts:  # one arrives each step: its prefill joins the running sequences' next token
        ids.append(engine.add_request(prompt, GREEDY))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.mixed_steps > 0
    assert [engine.pop_output(i).completion_ids for i in ids] == _want(model, prompts)


def test_a_released_request_resumes_exactly_on_another_engine():
    model = tiny_family_model("qwen3_5_moe_text", seed=5)
    prompts = random_prompts(3, seed=7, min_len=3, max_len=9)
    first = RolloutEngine(model, RolloutConfig())
    ids = [first.add_request(p, GREEDY) for p in prompts]
    for _ in range(5):
        first.step()
    released = [first.release(i) for i in ids]
    assert first.runner.states.num_free == first.runner.states.num_slots - 1  # released: slots back
    second = RolloutEngine(model, RolloutConfig())
    again = [second.add_request(p, GREEDY, resume=r) for p, r in zip(prompts, released)]
    while second.has_unfinished():
        second.step()
    assert [second.pop_output(i).completion_ids for i in again] == _want(model, prompts)


def test_an_aborted_request_frees_its_slot_and_the_others_stay_exact():
    model = tiny_family_model("qwen3_5_text", seed=6)
    prompts = random_prompts(3, seed=8, min_len=3, max_len=9)
    engine = RolloutEngine(model, RolloutConfig(max_num_seqs=2))

    def abort_first(step, ids):
        if step == 3:
            engine.abort(ids[0])

    outs = _run(engine, prompts, each_step=abort_first)
    assert [o.completion_ids for o in outs[1:]] == _want(model, prompts[1:])
    assert engine.runner.states.num_free == 2


@pytest.mark.parametrize(
    "config, words",
    [
        (dict(strategy="suffix"), "strategy 'suffix:8,2,16': the model's Gated DeltaNet layers keep a recurrent state"),
        (dict(strategy="adaptive"), "strategy 'adaptive'"),
        (dict(prefix_caching=True), "prefix_caching: the model's Gated DeltaNet layers"),
    ],
)
def test_what_the_state_cannot_serve_yet_is_refused_by_name(config, words):
    with pytest.raises(ValueError, match=words):
        RolloutEngine(tiny_family_model("qwen3_5_text"), RolloutConfig(**config))
    engine = RolloutEngine(tiny_family_model("qwen3_5_text"), RolloutConfig())
    if "strategy" in config:
        with pytest.raises(ValueError, match=words):
            engine.set_strategy(config["strategy"])
        assert str(engine.strategy) == "none"


def test_the_slot_pool_keeps_scratch_and_refuses_what_it_does_not_hold():
    states = RecurrentStates(3)
    held = [states.allocate(), states.allocate()]
    assert sorted(held) == [1, 2] and states.num_free == 0
    with pytest.raises(RuntimeError, match="no recurrent state slot free"):
        states.allocate()
    states.free(held[0])
    for bad in (0, held[0], 3):
        with pytest.raises(ValueError, match="not held"):
            states.free(bad)
    with pytest.raises(ValueError, match="at least 2 slots"):
        RecurrentStates(1)
