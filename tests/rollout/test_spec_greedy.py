"""Greedy speculative decoding reproduces plain decoding and HF ``generate`` token for token."""

import functools

import pytest
from rollout_helpers import EOS, cached_model, hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import ARCHITECTURES, across_architectures, perturbed_copy, tiny_random_model


@functools.cache
def good_drafter(arch: str):
    return perturbed_copy(cached_model(arch), noise=0.3, seed=7)


@functools.cache
def bad_drafter(arch: str):
    return tiny_random_model(arch, seed=1234, num_layers=1, hidden_size=32)


DRAFTERS = {"good": good_drafter, "bad": bad_drafter, "self": cached_model}


def spec_engine(arch: str, strategy: str, drafter: str | None, **cfg) -> RolloutEngine:
    model = cached_model(arch)
    draft = DRAFTERS[drafter](arch) if drafter else None
    return RolloutEngine(model, RolloutConfig(strategy=strategy, **cfg), drafter=draft)


def plain_outputs(arch: str, prompts, params, **cfg):
    return RolloutEngine(cached_model(arch), RolloutConfig(**cfg)).generate(prompts, params)


def assert_same(got, want) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.completion_ids == b.completion_ids, f"request {i} differs"
        assert a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("arch,k", across_architectures([(k,) for k in range(1, 9)]))
def test_chain_matches_plain_decoding(arch, k):
    prompts = random_prompts(5, seed=k)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    want = plain_outputs(arch, prompts, params)
    drafter = ("good", "bad", "self")[k % 3]
    got = spec_engine(arch, f"chain:{k}", drafter).generate(prompts, params)
    assert_same(got, want)


@pytest.mark.parametrize(
    "arch,shape,drafter",
    across_architectures([(s, d) for s in ["1,3,3", "2,2,4", "3,2,6", "4,3,12", "6,2,10"] for d in ["good", "bad"]]),
)
def test_tree_matches_plain_decoding(arch, shape, drafter):
    prompts = random_prompts(4, seed=len(shape) + len(drafter))
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    want = plain_outputs(arch, prompts, params)
    got = spec_engine(arch, f"tree:{shape}", drafter).generate(prompts, params)
    assert_same(got, want)


@pytest.mark.parametrize("arch,strategy", across_architectures([("suffix",), ("suffix:4",), ("suffix:6,3,12",)]))
def test_suffix_drafter_matches_hf_generate(arch, strategy):
    # repetitive prompts give the n-gram index something to find
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11], [3] * 6, [20, 21, 22]]
    engine = spec_engine(arch, strategy, None)
    got = engine.generate(prompts * 2, SamplingParams(max_new_tokens=30, temperature=0.0))
    for prompt, out in zip(prompts * 2, got):
        assert out.completion_ids == hf_greedy(cached_model(arch), prompt, 30)
    assert engine.stats.drafted_tokens > 0


@pytest.mark.parametrize("arch,strategy", across_architectures([("hybrid",), ("hybrid:3,1,6",), ("hybrid:5,3,16",)]))
def test_hybrid_matches_plain_decoding(arch, strategy):
    prompts = random_prompts(5, seed=4) + [[5, 6, 7, 5, 6, 7, 5, 6]] * 3
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    want = plain_outputs(arch, prompts, params)
    engine = spec_engine(arch, strategy, "good")
    assert_same(engine.generate(prompts, params), want)
    assert engine.stats.accepted_tokens > 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ragged_batch_with_eos_matches_hf(arch):
    prompts = random_prompts(8, seed=11, max_len=30)
    engine = spec_engine(arch, "tree:3,2,5", "good")
    got = engine.generate(prompts, [SamplingParams(max_new_tokens=5 + 4 * i, temperature=0.0) for i in range(8)])
    for i, (prompt, out) in enumerate(zip(prompts, got)):
        want = hf_greedy(cached_model(arch), prompt, 5 + 4 * i, eos_id=EOS)
        assert out.completion_ids == want
        assert len(out.completion_ids) <= 5 + 4 * i


@pytest.mark.parametrize(
    "arch,strategy,drafter", across_architectures([("chain:4", "good"), ("tree:4,2,8", "bad"), ("suffix", None)])
)
def test_forced_preemption_matches_plain(arch, strategy, drafter):
    prompts = random_prompts(10, seed=3, min_len=10, max_len=30)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    want = plain_outputs(arch, prompts, params)
    engine = spec_engine(arch, strategy, drafter, block_size=4, num_blocks=40)
    got = engine.generate(prompts, params)
    assert engine.stats.preemptions > 0
    assert_same(got, want)


def test_drafter_identical_to_target_accepts_every_draft():
    prompts = random_prompts(6, seed=5)
    engine = spec_engine("qwen2", "chain:4", "self")
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=33, temperature=0.0, ignore_eos=True))
    assert engine.stats.drafted_tokens > 0
    assert engine.stats.accepted_tokens == engine.stats.drafted_tokens
    for out in outs:
        assert out.num_accepted == out.num_drafted
        assert out.mean_accept_length > 4.0  # 33 tokens: 1 from prefill, then steps of 5 (the last one shorter)


def test_stop_token_inside_accepted_drafts_ends_the_sequence():
    arch = "llama"
    prompts = random_prompts(6, seed=21)
    stop = 17
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    want = plain_outputs(arch, prompts, params)
    got = spec_engine(arch, "chain:6", "self").generate(prompts, params)
    assert_same(got, want)
    for out in got:
        assert stop not in out.completion_ids[:-1]


def test_strategy_can_change_between_steps():
    arch = "qwen3"
    prompts = random_prompts(6, seed=8)
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    want = plain_outputs(arch, prompts, params)
    engine = spec_engine(arch, "none", "good")
    ids = [engine.add_request(p, params) for p in prompts]
    cycle = ["chain:3", "none", "tree:3,2,6", "suffix", "chain:1"]
    step = 0
    while engine.has_unfinished():
        engine.set_strategy(cycle[step % len(cycle)])
        engine.step()
        step += 1
    assert_same([engine.pop_output(i) for i in ids], want)


def test_prompt_groups_with_suffix_drafting_match_plain():
    arch = "qwen2"
    prompts = [p for p in random_prompts(3, seed=2) for _ in range(4)]
    params = SamplingParams(max_new_tokens=25, temperature=0.0)
    want = plain_outputs(arch, prompts, params)
    assert_same(spec_engine(arch, "suffix", None).generate(prompts, params), want)


def test_suffix_drafter_reuses_a_sibling_that_is_ahead():
    arch = "llama"
    prompt = random_prompts(1, seed=9)[0]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    engine = spec_engine(arch, "suffix:8", None)
    group = engine.new_group()
    leader = engine.add_request(prompt, params, group=group)
    for _ in range(30):
        engine.step()
    follower = engine.add_request(prompt, params, group=group)
    while engine.has_unfinished():
        engine.step()
    lead, follow = engine.pop_output(leader), engine.pop_output(follower)
    assert follow.completion_ids == lead.completion_ids == hf_greedy(cached_model(arch), prompt, 40, eos_id=-1)
    # the leader's text is in the group index: the follower takes long accepted steps
    assert follow.num_accepted >= 25
    assert follow.num_spec_steps < 15


def test_suffix_drafter_learns_from_earlier_calls():
    arch = "qwen3"
    prompts = random_prompts(4, seed=12)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    engine = spec_engine(arch, "suffix", None)
    first = engine.generate(prompts, params)
    accepted_before = engine.stats.accepted_tokens
    second = engine.generate(prompts, params)
    assert [o.completion_ids for o in first] == [o.completion_ids for o in second]
    assert engine.stats.accepted_tokens - accepted_before >= 4 * 20


def test_kv_blocks_are_all_returned():
    engine = spec_engine("llama", "tree:4,2,8", "good", block_size=4)
    engine.generate(random_prompts(8, seed=4), SamplingParams(max_new_tokens=20, temperature=0.0))
    allocator = engine.runner.cache.allocator
    assert allocator.num_free == allocator.num_blocks
    drafter_alloc = engine.drafter.allocator
    assert drafter_alloc.num_free == drafter_alloc.num_blocks


# the kernels' main path once (Triton's interpreter takes ~15 s a case; the test models share one
# head layout, so the kernels see the same shapes in every architecture). Trees through both
# kernels: test_spec_sampling.py's seeded samples (an EAGLE-3 tree) and test_graph_pool.py's
# padded forward (tree:3,2,6), which compares with the torch path; plain decoding: the latter too.
@pytest.mark.parametrize("arch,strategy,drafter", [("llama", "chain:3", "good")])
def test_triton_kernels_match_plain_decoding(arch, strategy, drafter):
    """Attention and verification through the Triton kernels (interpreter without CUDA), for the
    target and the drafter, reproduce plain decoding on the torch path token for token."""
    pytest.importorskip("triton")
    prompts = random_prompts(3, seed=13, max_len=12)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    want = plain_outputs(arch, prompts, params, kernels="torch")
    engine = spec_engine(arch, strategy, drafter, kernels="triton")
    assert_same(engine.generate(prompts, params), want)
    if drafter:
        assert engine.stats.drafted_tokens > 0


@functools.cache
def mistral(window: int | None):
    return tiny_random_model("mistral", seed=0, sliding_window=window)


MISTRAL_ENGINES = {
    "plain": {},
    "chain": {"strategy": "chain:3"},
    "tree, merged projections": {"strategy": "tree:3,2,6", "merge_projections": True},
    "chain, graphs": {"strategy": "chain:3", "graph_backend": "eager"},
}


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("engine", list(MISTRAL_ENGINES))
def test_mistral_decodes_as_hf_with_and_without_its_sliding_window(window, engine):
    """Mistral, with a sliding window shorter than prompt plus completion (it changes every one of
    these completions) and without: plain and speculative decoding, merged projections and the
    padded graph path give HF's greedy tokens (the compiled layers: tests/rollout/model/test_compiled.py;
    the split-KV kernel's window: tests/kernels/test_split_kv_attention.py)."""
    model = mistral(window)
    prompts = random_prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    cfg = MISTRAL_ENGINES[engine]
    drafter = perturbed_copy(model, noise=0.3, seed=7) if "strategy" in cfg else None
    got = RolloutEngine(model, RolloutConfig(**cfg), drafter=drafter).generate(prompts, params)
    assert [o.completion_ids for o in got] == [hf_greedy(model, p, 30) for p in prompts]
