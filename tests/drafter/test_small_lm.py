import pytest
import torch

from tailspec.draft_contract import Settled
from tailspec.drafter import DraftRequest, DraftShape, SmallLMDrafter
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.request import Sequence
from tailspec.tasks.tokenizer import build_tokenizer
from tailspec.testing import tiny_random_model


def test_vocabulary_mismatch_is_refused():
    target = tiny_random_model("qwen2", vocab_size=96)
    with pytest.raises(ValueError, match="vocabulary size 80 does not match the target's 96"):
        RolloutEngine(target, RolloutConfig(strategy="chain:2"), drafter=tiny_random_model("qwen2", vocab_size=80))


def test_tokenizer_mismatch_is_refused():
    tok = build_tokenizer()
    target = tiny_random_model("qwen2", vocab_size=len(tok))
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    drafter = SmallLMDrafter(tiny_random_model("qwen2", vocab_size=len(tok)), tokenizer=other)
    with pytest.raises(ValueError, match="tokenizer does not match"):
        RolloutEngine(target, RolloutConfig(strategy="chain:2"), drafter=drafter, tokenizer=tok)


def test_padded_vocabulary_is_accepted_with_matching_tokenizers():
    tok = build_tokenizer()
    target = tiny_random_model("qwen2", vocab_size=64)
    drafter = SmallLMDrafter(tiny_random_model("qwen2", vocab_size=len(tok)), tokenizer=tok)
    engine = RolloutEngine(target, RolloutConfig(strategy="chain:3"), drafter=drafter, tokenizer=tok)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    plain = RolloutEngine(target, RolloutConfig()).generate(
        [[5, 6, 7]], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    )
    # the random target also emits ids past the tokenizer (padding rows): those steps go undrafted
    assert out[0].completion_ids == plain[0].completion_ids


def test_non_drafter_objects_are_refused():
    with pytest.raises(ValueError, match="drafter must be"):
        RolloutEngine(tiny_random_model("llama"), drafter="small")


def _seq(seq_id, prompt, params=None):
    return Sequence(seq_id, list(prompt), params or SamplingParams(temperature=0.0), frozenset({1}))


def test_chain_draft_matches_the_drafters_own_greedy_continuation():
    model = tiny_random_model("llama", seed=4)
    drafter = SmallLMDrafter(model, block_size=4, kv_cache_tokens=256)
    drafter.bind(96)
    seq = _seq(0, [5, 9, 12, 40])
    (tree,) = drafter.propose([DraftRequest(seq, 5)], DraftShape(5))
    with torch.no_grad():
        ref = model.generate(torch.tensor([seq.prompt_ids]), do_sample=False, max_new_tokens=5, eos_token_id=None)
    assert tree.tokens == ref[0, 4:].tolist()[: len(tree.tokens)]
    assert tree.is_chain and tree.draft_probs is None


def test_drafter_cache_stays_in_step_with_accepted_tokens():
    model = tiny_random_model("qwen3", seed=2)
    drafter = SmallLMDrafter(model, block_size=4, kv_cache_tokens=256)
    drafter.bind(96)
    seq = _seq(0, [5, 9, 12, 40])
    (tree,) = drafter.propose([DraftRequest(seq, 4)], DraftShape(4))
    # accept two drafts, then the target emits a different token
    seq.output_ids += tree.tokens[:2] + [77]
    drafter.settled(seq, Settled(2))
    state = drafter._states[0]
    assert state.num_cached == 4 + 2  # prompt + the two accepted drafts still valid
    (tree2,) = drafter.propose([DraftRequest(seq, 3)], DraftShape(3))
    fresh = SmallLMDrafter(model, block_size=4, kv_cache_tokens=256)
    fresh.bind(96)
    (want,) = fresh.propose([DraftRequest(seq, 3)], DraftShape(3))
    assert tree2.tokens == want.tokens
    drafter.release(0)
    assert drafter.allocator.num_free == drafter.allocator.num_blocks


def test_pool_exhaustion_gives_no_draft_instead_of_failing():
    model = tiny_random_model("qwen2", seed=2)
    drafter = SmallLMDrafter(model, block_size=4, kv_cache_tokens=16)  # 4 blocks
    drafter.bind(96)
    seqs = [_seq(i, list(range(5, 15))) for i in range(2)]  # each needs 4 blocks with a 4-token chain
    trees = drafter.propose([DraftRequest(s, 4) for s in seqs], DraftShape(4))
    assert [len(t) for t in trees].count(0) == 1


def test_tree_draft_respects_shape_and_depth_limit():
    model = tiny_random_model("llama", seed=4)
    drafter = SmallLMDrafter(model, block_size=4, kv_cache_tokens=512)
    drafter.bind(96)
    seqs = [_seq(0, [5, 9, 12]), _seq(1, [7, 8])]
    trees = drafter.propose([DraftRequest(seqs[0], 4), DraftRequest(seqs[1], 2)], DraftShape(4, 3, 10))
    assert len(trees[0]) == 10 and max(trees[0].depths) <= 4
    assert len(trees[1]) <= 10 and max(trees[1].depths) <= 2
    for tree in trees:
        for kids in tree.children:
            assert len(kids) <= 3


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("noise", ["greedy", "position"])
def test_chains_drafted_on_the_device_equal_the_step_by_step_loop(monkeypatch, pooled, noise):
    """The device path runs every sequence to the deepest chain and reads once; it must cut each
    chain where the loop stops: at the sequence's own depth, and after a stop token (kept).
    Greedy and position-keyed drafts use no random draw, so the two paths draft the same tokens
    (sampled ones draw their uniforms at once on the device path: the same distribution)."""
    from tailspec.rollout.model.graph_pool import EagerBackend, GraphPool

    model = tiny_random_model("llama", seed=4)
    stop = frozenset(range(0, 96, 7))  # every seventh id: some chains stop early
    depths = [6, 1, 3, 6, 2, 5]

    def params(i: int) -> SamplingParams:
        if noise == "greedy":
            return SamplingParams(temperature=0.0)
        return SamplingParams(temperature=1.0, noise="position", seed=i)

    def drafts(on_device: bool) -> list:
        monkeypatch.setattr(SmallLMDrafter, "device_chains", on_device)
        pool = GraphPool(EagerBackend(torch.device("cpu"))) if pooled else None
        drafter = SmallLMDrafter(model, block_size=4, kv_cache_tokens=1024, graph_pool=pool)
        drafter.bind(96)
        out = []
        for step in range(3):  # later steps draft from a cache holding the earlier chains
            seqs = [
                Sequence(i, [5 + i, 9, 12 + 3 * i, 40 - i] + [i] * step, params(i), stop) for i in range(len(depths))
            ]
            trees = drafter.propose([DraftRequest(s, d) for s, d in zip(seqs, depths)], DraftShape(6))
            out += trees
            assert all((tree.draft_probs is None) == (noise == "greedy") for tree in trees)
        return out

    want, got = drafts(False), drafts(True)
    assert [t.tokens for t in got] == [t.tokens for t in want]
    assert any(len(t.tokens) < d and t.tokens[-1] in stop for t, d in zip(want, depths * 3))  # a stop cut
    for a, b in zip(got, want):  # the distributions depend on every position and K/V slot used
        if a.draft_probs is not None:
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)
