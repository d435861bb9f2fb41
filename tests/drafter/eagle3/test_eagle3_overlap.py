"""The engine's loop (each step launched before the one before it is committed) with an EAGLE-3
drafter, which reads the target's features at every forward: a launched step hands it a dropped
row's features too (past its sequence's last token), which must change neither a token nor a
recorded sample. The reference: every step committed before the next (``committed=True``)."""

import pytest
import torch
from eagle3_helpers import collect, random_head, target, trained_head

from tailspec.drafter.eagle3 import Eagle3Drafter
from tailspec.rollout import RolloutConfig, RolloutEngine
from tailspec.testing import random_prompts, stopping_params, with_synchronizations


def test_launched_plain_steps_record_the_samples_committed_steps_record():
    model, head = target("llama"), trained_head("llama")
    prompts = random_prompts(7, seed=41)
    params = stopping_params(model, prompts, n=24, stop_from=3)
    plain_engine, plain, plain_buffer = collect(model, head, prompts, params, committed=True)
    engine, outs, buffer = collect(model, head, prompts, params)
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    assert engine.stats.overlapped_steps > 0 and engine.stats.dropped_rows > 0
    _assert_same_samples(buffer.samples(), plain_buffer.samples(), len(prompts))


def _assert_same_samples(got, want, count: int) -> None:
    assert len(got) == len(want) == count
    for a, b in zip(sorted(got, key=lambda s: s.tokens.tolist()), sorted(want, key=lambda s: s.tokens.tolist())):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-5)  # other batch shapes
        torch.testing.assert_close(a.label_probs, b.label_probs, rtol=1e-4, atol=1e-5)


def test_chains_launched_on_the_device_decode_and_record_what_plain_decoding_does():
    """``chain:3``: the head catches up on the step before's rows from the
    device (the target's features there, the tokens it emitted) and drafts from the row of each
    sequence's last kept token; its recorder gets each step's kept rows when the host reads them.
    Tokens and recorded samples are plain decoding's. The target's forwards replay padded buckets
    (eager graphs: the features come out of the captured forward); the unpadded path of the same
    inputs is the drafter LM's test (tests/rollout/spec/test_device_step.py)."""
    graph_backend = "eager"
    model, head = target("llama"), trained_head("llama")
    prompts = random_prompts(7, seed=44)
    params = stopping_params(model, prompts, n=24, stop_from=3)
    _, plain, plain_buffer = collect(model, head, prompts, params, committed=True)
    host_read, _, _ = collect(model, head, prompts, params, "chain:3", committed=True, graph_backend=graph_backend)
    engine, outs, buffer = collect(model, head, prompts, params, "chain:3", graph_backend=graph_backend)
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    stats = engine.stats
    assert stats.overlapped_steps >= stats.spec_steps - 1 > 0 and stats.dropped_rows > 0
    # the head drafts from the device's state what it drafts from the host's (the same tokens accepted)
    assert stats.accepted_tokens == host_read.stats.accepted_tokens > 0
    _assert_same_samples(buffer.samples(), plain_buffer.samples(), len(prompts))


def test_trees_launched_on_the_device_decode_and_record_what_plain_decoding_does():
    """``tree:3,2,6``: the head grows static trees on the device and the step
    hands it the target's features at the accepted path's rows, so its catch-up and its recorder
    read a tree step as a chain's. Tokens and recorded samples are plain decoding's, and the trees
    accept about as many drafts as trees of the same shape each launched from the host's state."""
    model, head = target("llama"), trained_head("llama")
    prompts = random_prompts(7, seed=45)
    params = stopping_params(model, prompts, n=24, stop_from=3)
    _, plain, plain_buffer = collect(model, head, prompts, params, committed=True)
    host_read, _, _ = collect(model, head, prompts, params, "tree:3,2,6", committed=True)
    engine, outs, buffer = collect(model, head, prompts, params, "tree:3,2,6")
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    stats = engine.stats
    assert stats.overlapped_steps >= stats.spec_steps - 1 > 0 and stats.dropped_rows > 0
    per_step = stats.accepted_tokens / stats.spec_steps
    assert per_step > 0.7 * host_read.stats.accepted_tokens / host_read.stats.spec_steps > 0
    _assert_same_samples(buffer.samples(), plain_buffer.samples(), len(prompts))


def test_adaptive_moves_between_plain_steps_and_the_heads_chains():
    """The head catches up on features that plain steps handed it, then drafts; greedy output is
    plain decoding's."""
    model, head = target("llama"), trained_head("llama")
    prompts = random_prompts(7, seed=42)
    params = stopping_params(model, prompts, n=24, stop_from=3)
    plain = RolloutEngine(model, RolloutConfig()).generate(prompts, params)
    engine = RolloutEngine(model, RolloutConfig(strategy="adaptive"), drafter=Eagle3Drafter(head, model))
    by_kind = {arm.kind: arm for arm in engine.selector.arms}
    plans = iter(range(10**6))
    cycle = ["none", "none", "chain", "chain"]
    engine.selector.choose = lambda n, remaining, lag, context: by_kind[cycle[next(plans) % len(cycle)]]
    outs = engine.generate(prompts, params)
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    stats = engine.stats
    assert stats.overlapped_steps > 0 and stats.spec_steps > 0 and stats.accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_recording_for_online_training_leaves_launched_steps_without_a_wait():
    """Online head training's recorder under CUDA graphs: a forward's rows and soft labels go to
    the host in one queued copy, taken over once landed, so a launched step still makes no
    synchronizing call (sync debug mode flags them), and the samples are plain decoding's."""
    model = target("llama").cuda()
    head = random_head(model).cuda()
    prompts = random_prompts(5, seed=43)
    params = stopping_params(model, prompts, n=24, stop_from=3)
    cfg = {"block_size": 4, "kv_cache_tokens": 4096}
    _, plain, plain_buffer = collect(model, head, prompts, params, committed=True, **cfg)
    engine, _, buffer = collect(model, head, prompts, params, **cfg)  # captures the graphs
    recorded, prefills = len(buffer.samples()), engine.stats.prefill_steps
    outs, waits = with_synchronizations(lambda: engine.generate(prompts, params))
    assert [o.completion_ids for o in outs] == [o.completion_ids for o in plain]
    assert engine.stats.overlapped_steps > 0 and waits <= engine.stats.prefill_steps - prefills, waits
    _assert_same_samples(buffer.samples()[recorded:], plain_buffer.samples(), len(prompts))
