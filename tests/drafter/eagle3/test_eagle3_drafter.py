"""The EAGLE-3 head as an engine drafter: greedy output identical to plain decoding (chains and
trees, random and trained heads, full and reduced draft vocabularies, strategy switches), and the
drafter's paged forward equal to the trainer's unrolled one."""

import random

import pytest
import torch
from eagle3_helpers import random_head, random_prompts, target, trained_head

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, Eagle3Sample
from tailspec.drafter.eagle3 import drafter as eagle3_drafter_module
from tailspec.drafter.eagle3.model import vocab_from_counts
from tailspec.drafter.eagle3.train import collate, unroll
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.request import Sequence
from tailspec.testing import across_architectures, tiny_random_model


def plain(model, prompts, params):
    return RolloutEngine(model, RolloutConfig()).generate(prompts, params)


def spec(model, head, strategy, prompts, params, **cfg):
    engine = RolloutEngine(model, RolloutConfig(strategy=strategy, **cfg), drafter=Eagle3Drafter(head, model))
    return engine, engine.generate(prompts, params)


def assert_same(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.completion_ids == b.completion_ids, f"request {i} differs"
        assert a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "arch,strategy,quality",
    across_architectures(
        [(s, q) for q in ["random", "trained"] for s in ["chain:1", "chain:3", "chain:6", "tree:3,2,6", "tree:4,3,12"]]
    ),
)
def test_greedy_matches_plain_decoding(arch, strategy, quality):
    model = target(arch)
    head = random_head(model) if quality == "random" else trained_head(arch)
    prompts = random_prompts(6, seed=len(strategy))
    params = SamplingParams(max_new_tokens=28, temperature=0.0)
    engine, got = spec(model, head, strategy, prompts, params)
    assert_same(got, plain(model, prompts, params))
    assert engine.stats.drafted_tokens > 0
    if quality == "trained":
        assert engine.stats.accepted_tokens > 0


def test_reduced_draft_vocabulary_is_lossless_and_maps_ids():
    model = target("qwen2")
    head = random_head(model, draft_vocab_size=40)
    counts = torch.arange(96).flip(0)  # low ids are "frequent"
    head.set_vocab_map(vocab_from_counts(counts, 40, always=[1]))
    assert head.t2d.sum() == 40 and bool(head.t2d[1]) and bool(head.t2d[:39].all())
    prompts = random_prompts(5, seed=9)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    for strategy in ("chain:3", "tree:3,2,6"):
        engine, got = spec(model, head, strategy, prompts, params)
        assert_same(got, plain(model, prompts, params))
        assert engine.stats.drafted_tokens > 0


def test_switching_strategies_mid_generation_needs_no_reprefill():
    model = target("llama")
    head = trained_head("llama")
    prompts = random_prompts(5, seed=31)
    params = SamplingParams(max_new_tokens=36, temperature=0.0)
    engine = RolloutEngine(model, RolloutConfig(strategy="none"), drafter=Eagle3Drafter(head, model))
    ids = [engine.add_request(p, params) for p in prompts]
    cycle = ["none", "chain:3", "suffix", "tree:3,2,5", "none", "chain:5"]
    step = 0
    while engine.has_unfinished():
        engine.set_strategy(cycle[step % len(cycle)])
        engine.step()
        step += 1
    got = [engine.pop_output(i) for i in ids]
    assert_same(got, plain(model, prompts, params))
    assert engine.stats.prefill_steps <= 2  # prefills only: switching never re-prefilled
    assert engine.stats.accepted_tokens > 0


def test_a_long_run_of_plain_steps_keeps_few_pending_tensors_and_catches_up_exactly(monkeypatch):
    """While plain steps run, the head's pending features are merged (few live tensors); the
    catch-up after them reads exactly what it would have read unmerged: same drafts, same output."""
    model = target("llama")
    head = trained_head("llama")
    prompts = random_prompts(3, seed=41)
    params = SamplingParams(max_new_tokens=60, temperature=0.0)

    def run() -> tuple[list, list[tuple[int, int]], int]:
        drafter = Eagle3Drafter(head, model)
        engine = RolloutEngine(model, RolloutConfig(strategy="none"), drafter=drafter)
        ids = [engine.add_request(p, params) for p in prompts]
        for _ in range(31):  # the prefill, then 30 plain steps: features pile up for the head
            engine.step()
        most_pending = max(len(state.pending) for state in drafter._states.values())
        assert all(state.feature_end - state.num_cached >= 30 for state in drafter._states.values())
        engine.set_strategy("chain:3")
        while engine.has_unfinished():
            engine.step()
        drafts = [(r.drafted, r.accepted) for r in engine.stats.spec_log]
        return [engine.pop_output(i) for i in ids], drafts, most_pending

    outputs, drafts, most_pending = run()
    assert most_pending < 16
    assert_same(outputs, plain(model, prompts, params))
    assert sum(d for d, _ in drafts) > 0 and sum(a for _, a in drafts) > 0
    monkeypatch.setattr(eagle3_drafter_module, "_MERGE_PENDING", 10**6)
    unmerged_outputs, unmerged_drafts, unmerged_pending = run()
    assert unmerged_pending > 30 and unmerged_drafts == drafts
    assert [o.completion_ids for o in unmerged_outputs] == [o.completion_ids for o in outputs]


def test_a_tiny_head_pool_gives_no_drafts_but_correct_output():
    model = target("qwen3")
    head = random_head(model)
    drafter = Eagle3Drafter(head, model, kv_cache_tokens=32, block_size=16)
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:3"), drafter=drafter)
    prompts = random_prompts(4, seed=5, min_len=20, max_len=25)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    assert_same(engine.generate(prompts, params), plain(model, prompts, params))
    assert drafter.cache.allocator.num_free == drafter.cache.num_blocks  # every block returned


def test_head_for_another_target_is_refused():
    model = target("llama")
    other = tiny_random_model("llama", hidden_size=32)
    head = Eagle3Head(Eagle3Config.for_target(other.config))
    with pytest.raises(ValueError, match="hidden size 32"):
        Eagle3Drafter(head, model)
    wider_vocab = Eagle3Head(Eagle3Config.for_target(tiny_random_model("llama", vocab_size=128).config))
    with pytest.raises(ValueError, match="vocabulary size 128"):
        Eagle3Drafter(wider_vocab, model)


def test_paged_drafting_equals_the_unrolled_training_forward():
    """The drafter's catch-up + chain rows and the trainer's training-time-test unroll are the
    same computation: feeding the true tokens, step k at index t gives the same logits."""
    model = target("qwen2")
    head = random_head(model, std=0.05)
    tokens = random_prompts(1, seed=2, min_len=14, max_len=14)[0]
    with torch.no_grad():
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i][0] for i in head.config.aux_layer_ids], dim=-1)
    n, steps = len(tokens), 4
    sample = Eagle3Sample(torch.tensor(tokens), feats[:-1], 1)
    with torch.no_grad():
        train_logits = unroll(head, model.get_input_embeddings(), collate([sample], steps, 64, random.Random(0)), steps)

    for t in (3, 7):  # last real feature at index t
        drafter = Eagle3Drafter(head, model, kv_cache_tokens=256, block_size=4)
        seq = Sequence(0, tokens[: t + 2], SamplingParams(temperature=0.0), frozenset())
        drafter.observe(seq, 0, feats[: t + 1], torch.zeros(1, 96))
        state = drafter._states[0]
        assert drafter._ensure_room(state, n + steps)
        with torch.no_grad():
            hidden, logits = drafter._catch_up([seq])
            draft = [logits[0]]
            for k in range(1, steps):
                if t + k + 1 >= n:
                    break
                from tailspec.rollout.model.attention import SequenceSlice

                position = t + k
                hidden, logits = drafter._run(
                    [SequenceSlice(state.block_table, position, 1)], hidden, [tokens[t + k + 1]], [position]
                )
                draft.append(logits[0])
        for k, row in enumerate(draft):
            torch.testing.assert_close(row, train_logits[k][0, t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["chain:3", "tree:3,2,6"])
def test_the_target_forwards_that_feed_the_head_replay_from_the_graph_pool(strategy):
    """The features the head reads are an output of the captured forward (on a GPU an eager
    target forward cost 116 ms a step against a 5 ms replay): the drafts, and so what the steps
    accept, are those of the uncaptured engine, and the output is plain decoding's."""
    model = target("qwen2")
    head = trained_head("qwen2")
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    eager, want = spec(model, head, strategy, prompts, params, graph_backend="none")
    engine, got = spec(model, head, strategy, prompts, params, graph_backend="eager")
    assert_same(got, plain(model, prompts, params))
    assert_same(got, want)
    assert (engine.stats.drafted_tokens, engine.stats.accepted_tokens) == (
        eager.stats.drafted_tokens,
        eager.stats.accepted_tokens,
    )
    pool = engine.runner.graph_pool
    assert pool.stats.hits > 0 and all(key.taps == tuple(head.config.aux_layer_ids) for key in pool.keys())


def test_adaptive_calibrates_the_forward_that_taps_the_head_s_features():
    """Calibration times (and captures) the target forward the steps run: with the head's taps."""
    model = target("llama")
    head = trained_head("llama")
    config = RolloutConfig(strategy="adaptive", graph_backend="eager", max_num_seqs=4)
    engine = RolloutEngine(model, config, drafter=Eagle3Drafter(head, model))
    engine.choice.before_rollout(4)
    keys, table = engine.runner.graph_pool.keys(), engine.selector.costs.table
    # every timed shape, and at a longer context the two widths that price a cached token
    assert len(keys) == len(table.measured) + len(table.per_token) and len(table.per_token) == 2
    assert len({key.context for key in keys}) == 2
    assert all(key.taps == tuple(head.config.aux_layer_ids) for key in keys)


def test_greedy_matches_plain_decoding_through_the_triton_kernels():
    """The head's own paged attention and the verification run through the Triton kernels
    (interpreter without CUDA); the output is still plain decoding's. A tree (a chain is the tree
    with one branch per level to the kernels; a chain's verification through them:
    tests/rollout/test_spec_greedy.py; sampled, the head's attention through them:
    tests/rollout/test_spec_sampling.py)."""
    strategy = "tree:3,2,6"
    pytest.importorskip("triton")
    model = target("llama")
    prompts = random_prompts(3, seed=4, max_len=10)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    engine, got = spec(model, trained_head("llama"), strategy, prompts, params, kernels="triton")
    assert_same(got, plain(model, prompts, params))
    assert engine.stats.accepted_tokens > 0


@pytest.mark.parametrize(
    "arch,strategy,executor",
    across_architectures([(s, e) for e in ["inline", "thread"] for s in ["mirror:chain:3,k=0", "mirror:chain:4,k=2"]]),
)
def test_greedy_mirror_with_the_head_matches_plain_decoding(arch, strategy, executor):
    """The head drafts branches over tokens the target has not verified from its own hidden
    states; what it keeps is only what real features computed."""
    model = target(arch)
    prompts = random_prompts(6, seed=3)
    params = SamplingParams(max_new_tokens=28, temperature=0.0)
    drafter = Eagle3Drafter(trained_head(arch), model)
    config = RolloutConfig(strategy=strategy, mirror={"executor": executor})
    engine = RolloutEngine(model, config, drafter=drafter)
    assert_same(engine.generate(prompts, params), plain(model, prompts, params))
    assert engine.drafters.mirror.pipeline.stats.branches > 0
    engine.close()


def test_the_head_in_a_draft_process_drafts_exactly_as_in_this_one_and_follows_training():
    """A copy of the head in a child process (its weights and the target's embeddings shipped,
    each forward's feature rows sent after it) drafts what the in-process head drafts: greedy
    mirror runs with either accept the same tokens and keep the same branches, before and after
    the head's weights change in this process."""
    model = target("qwen3")
    head = trained_head("qwen3")
    prompts = random_prompts(5, seed=8)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    want = plain(model, prompts, params)
    engines = {
        executor: RolloutEngine(
            model,
            RolloutConfig(strategy="mirror:chain:3,k=1", mirror={"executor": executor}),
            drafter=Eagle3Drafter(head, model),
        )
        for executor in ("inline", "process")
    }
    assert type(engines["process"].drafters.mirror.pipeline.executor).__name__ == "ProcessExecutor"
    for _ in range(2):
        for engine in engines.values():
            assert_same(engine.generate(prompts, params), want)
        inline, process = (engines[e] for e in ("inline", "process"))
        assert process.stats.accepted_tokens == inline.stats.accepted_tokens > 0
        assert process.drafters.mirror.pipeline.stats.ready == inline.drafters.mirror.pipeline.stats.ready
        with torch.no_grad():  # a training step of the head, in this process
            for p in head.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    assert not engines["process"].drafters.mirror.hostable  # a peer's host could not catch up without features
    for engine in engines.values():
        engine.close()


def test_an_eagle3_drafter_needs_a_target_or_embeddings():
    with pytest.raises(ValueError, match="exactly one of target"):
        Eagle3Drafter(random_head(target("llama")))


def test_a_branch_over_the_head_s_own_draft_continues_that_draft():
    """Over tokens with no target features the head feeds its own hidden outputs, exactly as it
    drafts: a branch assuming its first 3 drafted tokens continues the same greedy chain."""
    from tailspec.draft_contract import BranchView, DraftRequest, DraftShape

    model = target("qwen2")
    drafter = Eagle3Drafter(random_head(model), model)
    engine = RolloutEngine(model, RolloutConfig(), drafter=drafter)
    rid = engine.add_request(random_prompts(1, seed=4)[0], SamplingParams(max_new_tokens=20, temperature=0.0))
    engine.step()  # the prefill: the drafter observes the prompt's features
    engine.step()  # one decode step: more features, one more token
    engine.sync()  # its token committed: the host's state is the drafter's
    seq = engine.requests.seqs[rid]
    with torch.no_grad():
        whole = drafter.propose([DraftRequest(seq, 7)], DraftShape(7))[0].tokens
        branch = drafter.propose_branches([DraftRequest(BranchView(seq, whole[:3]), 4)], DraftShape(4))[0].tokens
    assert len(whole) == 7 and branch == whole[3:]


def test_chains_drafted_on_the_device_equal_the_step_by_step_loop(monkeypatch):
    """The head drafts chains on the device with one read a step; the tokens equal the loop that
    reads each forward's (same drafts: the same counts of drafted and accepted tokens)."""
    model = target("llama")
    head = trained_head("llama")
    prompts = random_prompts(5, seed=11)
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    on_device, got = spec(model, head, "chain:5", prompts, params)
    monkeypatch.setattr(Eagle3Drafter, "_device_chain", lambda self, requests, h, lg: self._chain(requests, h, lg))
    step_by_step, want = spec(model, head, "chain:5", prompts, params)
    assert_same(got, want)
    counts = ("drafted_tokens", "accepted_tokens", "spec_steps")
    assert [getattr(on_device.stats, c) for c in counts] == [getattr(step_by_step.stats, c) for c in counts]
    assert on_device.stats.accepted_tokens > 0


def test_device_trees_equal_the_search_run_path_by_path_on_the_host():
    """The head's static trees on the device (each level's paths in one forward, every row fed its
    parent's hidden output from the level before) equal the same search whose paths are run one
    token at a time from the root's hidden output, sequence by sequence."""
    import copy

    from tailspec.draft_contract import DeviceDraftInputs, DraftShape, static_tree_scratch
    from tailspec.drafter.tree_search import grow_static_trees
    from tailspec.rollout.model.attention import SequenceSlice

    model = target("qwen2")
    drafter = Eagle3Drafter(trained_head("qwen2"), model)
    engine = RolloutEngine(model, RolloutConfig(), drafter=drafter)
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    ids = [engine.add_request(p, params) for p in random_prompts(3, seed=13)]
    engine.step()  # the prefill: the head observes the prompts' features
    engine.step()  # one decode step
    engine.sync()  # its token committed: the host's state is the drafter's
    seqs = [engine.requests.seqs[i] for i in ids]
    shape = DraftShape(4, 3, 12)
    lengths = [s.num_cached + 1 + static_tree_scratch(shape) for s in seqs]
    twin = copy.deepcopy(drafter)
    cached = torch.tensor([s.num_cached for s in seqs])
    two = torch.tensor([[s.token_at(s.num_cached - 1), s.token_at(s.num_cached)] for s in seqs])
    with torch.no_grad():
        assert drafter._reserve_on_device(seqs, lengths, True)
        got = drafter._tree_on_device(DeviceDraftInputs(cached, two, None, seqs, max(lengths) + 1), shape)
        assert twin._reserve_on_device(seqs, lengths, True)
        root_hidden, root_logits = twin._catch_up(seqs)

        def level(paths, _extends):
            rows = []
            for b, seq in enumerate(seqs):
                state = twin._states[seq.seq_id]
                for path in paths[b].tolist():
                    hidden = root_hidden[b : b + 1]
                    for j, token in enumerate(path):
                        at = state.num_cached + j
                        hidden, logits = twin._run([SequenceSlice(state.block_table, at, 1)], hidden, [token], [at])
                    rows.append(torch.log_softmax(logits[0], dim=-1))
            return torch.stack(rows).view(len(seqs), paths.shape[1], -1)

        want = grow_static_trees(torch.log_softmax(root_logits, dim=-1), shape, level)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_device_chains_draft_the_loop_s_tokens_and_distributions():
    """Position-keyed sampling: the drafts and their distributions (which depend on every position
    and K/V slot the head's forwards use) equal the step-by-step loop's, from the same state."""
    import copy

    from tailspec.draft_contract import DraftRequest, DraftShape

    model = target("qwen2")
    drafter = Eagle3Drafter(trained_head("qwen2"), model)
    engine = RolloutEngine(model, RolloutConfig(), drafter=drafter)
    params = [SamplingParams(max_new_tokens=30, temperature=1.0, noise="position", seed=s) for s in range(4)]
    ids = [engine.add_request(p, sp) for p, sp in zip(random_prompts(4, seed=12), params)]
    engine.step()  # the prefill: the head observes the prompts' features
    engine.step()  # one decode step
    engine.sync()  # its token committed: the host's state is the drafter's
    twin = copy.deepcopy(drafter)
    twin._device_chain = lambda requests, h, lg: twin._chain(requests, h, lg)
    requests = [DraftRequest(engine.requests.seqs[i], d) for i, d in zip(ids, [5, 2, 5, 4])]
    with torch.no_grad():
        got = drafter.propose(requests, DraftShape(5))
        want = twin.propose(requests, DraftShape(5))
    assert [t.tokens for t in got] == [t.tokens for t in want] and all(len(t.tokens) for t in got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)
