"""Serving from an inbox, and requests that move between engines mid-way: nothing of it may show
in the output (greedy equals plain decoding; a seeded request draws the same tokens wherever it
runs; speculative strategies included)."""

import threading

import pytest
from rollout_helpers import EOS, cached_model, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.handoff import InboxItem, RequestInbox

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def _engine(model, strategy="none", **kw):
    return RolloutEngine(model, RolloutConfig(kv_cache_tokens=4096, strategy=strategy, **kw), eos_token_ids=[EOS])


def _serve_all(engine, inbox):
    finished, released = {}, {}
    for update in engine.serve(inbox, idle_wait_s=0.05):
        finished.update(update.finished)
        released.update(update.released)
    return finished, released


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_serve_matches_generate_across_submissions(arch):
    model = cached_model(arch)
    prompts = random_prompts(6, seed=3) + [random_prompts(1, seed=4)[0]] * 3  # a group of three
    reference = _engine(model).generate(prompts, GREEDY)
    engine, inbox = _engine(model), RequestInbox()
    inbox.put([InboxItem(i, p, GREEDY) for i, p in enumerate(prompts[:4])])
    updates = engine.serve(inbox, idle_wait_s=0.05)
    got = dict(next(updates).finished)  # the first finished request(s)
    inbox.put([InboxItem(i, p, GREEDY) for i, p in enumerate(prompts) if i >= 4])  # joins the running batch
    inbox.close(len(prompts))
    for update in updates:
        got.update(update.finished)
    assert sorted(got) == list(range(len(prompts)))
    for i, ref in enumerate(reference):
        assert got[i].completion_ids == ref.completion_ids
    assert engine.runner.cache.allocator.num_free == engine.runner.cache.allocator.num_blocks


@pytest.mark.parametrize("strategy", ["none", "suffix", "chain:3"])
def test_release_and_resume_elsewhere_is_invisible(strategy):
    """Greedy: a request moved after some tokens completes exactly as if it never moved."""
    model = cached_model("qwen2")
    drafter = cached_model("qwen2", seed=5) if strategy.startswith("chain") else None
    prompts = random_prompts(4, seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    reference = RolloutEngine(model, RolloutConfig(kv_cache_tokens=4096), eos_token_ids=[EOS]).generate(prompts, params)

    donor = RolloutEngine(
        model, RolloutConfig(kv_cache_tokens=4096, strategy=strategy), eos_token_ids=[EOS], drafter=drafter
    )
    receiver = RolloutEngine(
        model, RolloutConfig(kv_cache_tokens=4096, strategy=strategy), eos_token_ids=[EOS], drafter=drafter
    )
    ids = [donor.add_request(p, params) for p in prompts]
    for _ in range(6):
        donor.step()
    partials = {i: donor.release(ids[i]) for i in (1, 3)}
    assert all(0 < p.num_generated < 40 for p in partials.values())
    moved = {receiver.add_request(prompts[i], params, resume=p): i for i, p in partials.items()}
    outputs = {}
    while donor.has_unfinished():
        for r in donor.step():
            outputs[ids.index(r)] = donor.pop_output(r)
    while receiver.has_unfinished():
        for r in receiver.step():
            outputs[moved[r]] = receiver.pop_output(r)
    for i, ref in enumerate(reference):
        assert outputs[i].completion_ids == ref.completion_ids, i
        assert outputs[i].logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    for engine in (donor, receiver):
        assert engine.runner.cache.allocator.num_free == engine.runner.cache.allocator.num_blocks


def test_seeded_request_draws_the_same_tokens_after_a_move():
    model = cached_model("llama")
    prompt = random_prompts(1, seed=11)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=1234, ignore_eos=True)
    reference = _engine(model).generate([prompt], params)[0]
    donor, receiver = _engine(model), _engine(model)
    rid = donor.add_request(prompt, params)
    other = donor.add_request(random_prompts(1, seed=12)[0], SamplingParams(max_new_tokens=30))  # shares the batch
    for _ in range(9):
        donor.step()
    partial = donor.release(rid)
    new = receiver.add_request(prompt, params, resume=partial)
    out = None
    while out is None:
        if new in receiver.step():
            out = receiver.pop_output(new)
    assert out.completion_ids == reference.completion_ids
    donor.abort(other)


def test_inbox_release_of_waiting_items_and_unknown_keys():
    model = cached_model("llama")
    engine, inbox = _engine(model, max_num_seqs=2), RequestInbox()
    prompts = random_prompts(5, seed=21)
    inbox.put([InboxItem(10 + i, p, GREEDY) for i, p in enumerate(prompts)])
    inbox.release([12, 99])  # 12 has not been taken yet; 99 was never sent
    inbox.close(5)
    finished, released = _serve_all(engine, inbox)
    assert released == {12: None}
    assert sorted(finished) == [10, 11, 13, 14]


def test_serve_waits_for_items_promised_by_close():
    """close() may overtake the put() it counts (threaded actors): the session waits for them."""
    model = cached_model("llama")
    engine, inbox = _engine(model), RequestInbox()
    prompts = random_prompts(3, seed=31)
    inbox.close(3)
    timer = threading.Timer(0.2, lambda: inbox.put([InboxItem(i, p, GREEDY) for i, p in enumerate(prompts)]))
    timer.start()
    finished, _ = _serve_all(engine, inbox)
    timer.join()
    assert sorted(finished) == [0, 1, 2]


def test_resume_refuses_a_partial_of_another_request():
    model = cached_model("llama")
    engine = _engine(model)
    prompts = random_prompts(2, seed=41)
    params = GREEDY.with_updates(ignore_eos=True)
    rid = engine.add_request(prompts[0], params)
    engine.step()
    partial = engine.release(rid)
    with pytest.raises(ValueError, match="resume"):
        engine.add_request(prompts[1], params, resume=partial)
    with pytest.raises(ValueError, match="not running"):
        engine.release(rid)
