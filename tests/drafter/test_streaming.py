"""Speculative streaming: several draft tokens per drafter forward, still lossless."""

import functools

import pytest
import torch

from tailspec.draft_contract import DraftRequest, DraftShape
from tailspec.drafter.small_lm import SmallLMDrafter
from tailspec.drafter.streaming import StreamingHeads, StreamingHeadTrainer, fit_streaming_heads, lm_head_inputs
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.mirror.hosted import SeqSnapshot
from tailspec.testing import ARCHITECTURES, perturbed_copy, random_prompts, tiny_random_model


@functools.cache
def target(arch: str):
    return tiny_random_model(arch, seed=1, initializer_range=0.2)


def random_heads(model, num_heads: int, seed: int = 0) -> StreamingHeads:
    torch.manual_seed(seed)
    heads = StreamingHeads(model.config.hidden_size, num_heads)
    for block in heads.blocks:
        torch.nn.init.normal_(block.weight, std=0.2)
    return heads


def streaming_drafter(arch: str, num_heads: int = 2, **kwargs) -> SmallLMDrafter:
    draft = perturbed_copy(target(arch), noise=0.3, seed=7)
    return SmallLMDrafter(draft, streaming_heads=random_heads(draft, num_heads), **kwargs)


def _plain(model, prompts, params):
    return RolloutEngine(model, RolloutConfig()).generate(prompts, params)


def _assert_plain(engine, arch, outputs, prompts, params):
    for a, b in zip(outputs, _plain(target(arch), prompts, params)):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert engine.stats.drafted_tokens > 0


# chains are drafted from state on the device: chain:7 with two heads streams blocks of 3, 3 and 1
# (the last never fed, so the next step's root refeeds what was emitted); mirror steps from the host's
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("strategy", ["chain:4", "chain:7", "mirror:chain:4,k=0"])
def test_greedy_with_streaming_heads_matches_plain_decoding(arch, strategy):
    prompts = random_prompts(5, seed=6)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    config = RolloutConfig(strategy=strategy, mirror={"executor": "inline"})
    engine = RolloutEngine(target(arch), config, drafter=streaming_drafter(arch))
    _assert_plain(engine, arch, engine.generate(prompts, params), prompts, params)
    assert (engine.stats.overlapped_steps > 0) == (not strategy.startswith("mirror"))
    engine.close()


def test_streamed_chains_and_trees_in_turn_decode_as_plain_decoding():
    """Each step launched from the one in flight, the strategy switched every step: a tree's root
    after a streamed chain, a streamed chain after a tree, chains of other depths after both."""
    arch = "llama"
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    engine = RolloutEngine(target(arch), RolloutConfig(), drafter=streaming_drafter(arch))
    ids = [engine.add_request(p, params) for p in prompts]
    strategies, step = ["chain:4", "tree:3,2,6", "chain:2", "chain:6", "tree:2,2,3"], 0
    while engine.has_unfinished():
        engine.set_strategy(strategies[step % len(strategies)])
        engine.step()
        step += 1
    _assert_plain(engine, arch, [engine.pop_output(i) for i in ids], prompts, params)
    assert engine.stats.overlapped_steps > step // 2
    engine.close()


def test_the_drafter_forwards_that_feed_the_heads_replay_from_its_graph_pool():
    """The heads read the LM head's input, an output of the drafter's captured forward (on CUDA
    its forwards replay graphs; they ran eagerly for the heads' hook): the same drafts as eager."""
    from tailspec.rollout.model.graph_pool import EagerBackend, GraphPool
    from tailspec.rollout.model.layer_taps import LM_HEAD_INPUT

    prompts = random_prompts(4, seed=2)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    counts, want = [], _plain(target("qwen2"), prompts, params)
    for pool in (None, GraphPool(EagerBackend())):
        drafter = streaming_drafter("qwen2", graph_pool=pool)
        engine = RolloutEngine(target("qwen2"), RolloutConfig(strategy="chain:4"), drafter=drafter)
        got = engine.generate(prompts, params)
        assert [o.completion_ids for o in got] == [o.completion_ids for o in want]
        counts.append((engine.stats.drafted_tokens, engine.stats.accepted_tokens))
    assert counts[0] == counts[1] and counts[0][1] > 0
    assert pool.stats.hits > 0 and {key.taps for key in pool.keys()} == {(LM_HEAD_INPUT,)}


def test_streaming_heads_cross_to_a_draft_process():
    arch = "qwen2"
    prompts = random_prompts(4, seed=2)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    config = RolloutConfig(strategy="mirror:chain:4,k=0", mirror={"executor": "process"})
    drafter = streaming_drafter(arch)
    engine = RolloutEngine(target(arch), config, drafter=drafter)
    for a, b in zip(engine.generate(prompts, params), _plain(target(arch), prompts, params)):
        assert a.completion_ids == b.completion_ids
    request = [DraftRequest(SeqSnapshot(5, prompts[0], [], None, frozenset(), params), 6)]
    assert (
        engine.drafters.mirror.pipeline.drafter.propose(request, DraftShape(6))[0].tokens
        == drafter.propose(request, DraftShape(6))[0].tokens
    )
    # the heads train in this process (online streaming-head training): the copy follows them
    StreamingHeadTrainer(drafter.model, drafter.heads, lr=0.05).train([p + [1, 2, 3] for p in prompts], steps=5)
    engine.drafters.mirror.pipeline.executor.refresh()
    request = [DraftRequest(SeqSnapshot(6, prompts[1], [], None, frozenset(), params), 6)]
    mine = drafter.propose(request, DraftShape(6))[0].tokens
    assert engine.drafters.mirror.pipeline.drafter.propose(request, DraftShape(6))[0].tokens == mine
    engine.close()


@pytest.mark.parametrize("num_heads,forwards", [(0, 6), (1, 3), (2, 2), (5, 1)])
def test_a_chain_costs_fewer_forwards_with_more_heads(monkeypatch, num_heads, forwards):
    """A chain of 6 from a fresh sequence: the catch-up, then one forward per (1 + heads) tokens
    (none after the last)."""
    draft = perturbed_copy(target("llama"), noise=0.3, seed=7)
    heads = random_heads(draft, num_heads) if num_heads else None
    drafter = SmallLMDrafter(draft, kv_cache_tokens=256, streaming_heads=heads)
    calls = []
    for name in ("forward", "forward_with_features"):  # with heads, every forward returns their input
        real = getattr(drafter.runner, name)
        monkeypatch.setattr(drafter.runner, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    view = SeqSnapshot(0, random_prompts(1, seed=3)[0], [], None, frozenset(), SamplingParams(temperature=0.0))
    tree = drafter.propose([DraftRequest(view, 6)], DraftShape(6))[0]
    assert len(tree) == 6 and len(calls) == forwards


def test_fitting_the_heads_teaches_them_the_tokens_after_next():
    model = perturbed_copy(target("qwen3"), noise=0.0)
    g = torch.Generator().manual_seed(0)
    # sequences with a rule to learn: a cycle of 5 tokens from a random start
    sequences = [[(s + i) % 5 + 10 for i in range(40)] for s in torch.randint(0, 5, (24,), generator=g).tolist()]
    heads = StreamingHeads(model.config.hidden_size, 2)
    before = _head_accuracy(model, heads, sequences)
    losses = fit_streaming_heads(model, heads, sequences, steps=150, lr=5e-3)
    assert losses[-1] < losses[0] / 2
    assert _head_accuracy(model, heads, sequences) > max(before, 0.9)


def _head_accuracy(model, heads, sequences) -> float:
    hits = total = 0
    with torch.no_grad():
        for tokens in sequences:
            hidden, _ = lm_head_inputs(model, torch.tensor([tokens]))
            for j in range(len(heads)):
                n = len(tokens) - 2 - j
                guess = model.lm_head(heads.hidden(j, hidden[:n])).argmax(-1)
                hits += int((guess == torch.tensor(tokens[2 + j : 2 + j + n])).sum())
                total += n
    return hits / total


def test_bad_head_counts_are_refused():
    with pytest.raises(ValueError, match=r"streaming heads must be an int in \[1, 8\]"):
        StreamingHeads(64, 0)


@pytest.mark.parametrize("num_heads,depth", [(1, 5), (2, 4), (3, 2)])
def test_the_streamed_held_out_score_equals_an_enumeration_of_the_streamed_chain(num_heads, depth):
    """A streamed chain from t: the forward at t drafts t + 1 (LM head) and t + 2 + j (head j); the
    next forward reads position t + heads + 1. The score sums, over completion positions, the chance
    that a chain sampled this way matches at least k emitted tokens, for k up to ``depth``."""
    from tailspec.drafter.lm_trainer import SequenceSample
    from tailspec.drafter.streaming import streamed_held_out_acceptance

    drafter = streaming_drafter("llama", num_heads)
    model, heads = drafter.model, drafter.heads
    samples = [SequenceSample.of(p, c) for p, c in [([5, 6, 7], [8, 9, 10, 11, 12, 13]), ([3, 4], [9, 2, 7, 7, 1])]]
    head = model.get_output_embeddings()
    accepted = positions = 0.0
    for s in samples:
        tokens = s.tokens.long().tolist()
        with torch.no_grad():
            hidden, logits = lm_head_inputs(model, torch.tensor([tokens]))
            guesses = [torch.softmax(logits.float(), -1)]
            guesses += [torch.softmax(head(heads.hidden(j, hidden)).float(), -1) for j in range(num_heads)]
        for t in range(s.prompt_len - 1, len(tokens) - 1):
            positions += 1
            run = 1.0
            for k in range(depth):
                forward_at, offset = t + (k // (num_heads + 1)) * (num_heads + 1), k % (num_heads + 1)
                drafted = forward_at + 1 + offset  # the token this draft guesses
                if drafted >= len(tokens):
                    break
                run *= float(guesses[offset][forward_at, tokens[drafted]])
                accepted += run
    score = streamed_held_out_acceptance(model, heads, samples, depth)
    assert score == pytest.approx(accepted / positions, rel=1e-5)
    assert streamed_held_out_acceptance(model, heads, samples, depth, should_stop=lambda: True) is None


@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_a_streamed_chain_drafted_on_the_device_equals_the_host_s(accepted):
    """From a step left on the device (its pending token at ``c``, ``accepted`` drafts and the final
    token emitted after it, padding past them), the drafter refeeds what was emitted, then streams
    blocks of 3 (the LM head and two heads) as the host does from the tokens it read."""
    import copy

    from tailspec.draft_contract import DeviceDraftInputs, StepOnDevice
    from tailspec.rollout.model.kv_cache import slot_of

    arch, depth, width = "qwen2", 7, 6  # width: the step before's depth + 1
    drafter = streaming_drafter(arch)
    engine = RolloutEngine(target(arch), RolloutConfig(strategy="chain:3"), drafter=drafter)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(3, seed=13)]
    for _ in range(4):  # the prefill, then chains: the drafter holds each sequence's prefix
        engine.step()
    seqs = [engine.requests.seqs[i] for i in ids]
    twin = copy.deepcopy(drafter)
    cached = torch.tensor([s.num_cached for s in seqs])  # the pending tokens' positions
    start = cached - accepted - 1  # the step before's pending token
    emitted = torch.zeros(len(seqs), width, dtype=torch.long)  # padding past its final token: 0
    for b, seq in enumerate(seqs):
        emitted[b, : accepted + 1] = torch.tensor([seq.token_at(int(start[b]) + 1 + j) for j in range(accepted + 1)])
    two = torch.tensor([[s.token_at(s.num_cached - 1), s.token_at(s.num_cached)] for s in seqs])
    previous = StepOnDevice(start, emitted, torch.full((len(seqs),), accepted))
    lengths = [s.num_cached + 1 + depth for s in seqs]
    with torch.no_grad():
        assert drafter._reserve_on_device(seqs, lengths, True)
        cache = drafter.runner.cache
        for b, seq in enumerate(seqs):  # what it holds past the step before's pending token is never read
            state = drafter._states[seq.seq_id]
            state.num_cached = int(start[b]) + 1
            past = [slot_of(state.block_table, i, cache.block_size) for i in range(state.num_cached, lengths[b])]
            for kv in (*cache.k, *cache.v):
                kv[past] = torch.randn_like(kv[past])
        inputs = DeviceDraftInputs(cached, two, previous, seqs, max(lengths) + width)
        got, _ = drafter._chain_on_device(inputs, depth)
    want = twin.propose([DraftRequest(seq, depth) for seq in seqs], DraftShape(depth))
    assert got.tolist() == [tree.tokens for tree in want]
