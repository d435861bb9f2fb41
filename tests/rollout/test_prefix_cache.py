"""RolloutConfig.prefix_caching: finished requests leave their full KV blocks for requests that
start with the same tokens; outputs are unchanged, stale K/V is never reused."""

import pytest
import torch
from rollout_helpers import cached_model, hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.kv_cache import BlockAllocator, prefix_hashes

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def test_allocator_keeps_registered_blocks_until_evicted():
    a = BlockAllocator(4, cache_prefixes=True)
    b0, b1 = a.allocate(2)
    h0, h1 = prefix_hashes([1, 2, 3, 4], 2, 2)
    a.register(b0, h0)
    a.free([b0, b1])
    assert a.num_free == 4 and a.lookup(h0) == b0 and a.num_cached_blocks == 1
    a.reuse(b0)
    assert a.refcount(b0) == 1 and a.num_free == 3
    a.free([b0])
    assert a.allocate(3) and a.lookup(h0) == b0  # free blocks go first
    assert a.allocate(1) == [b0] and a.lookup(h0) is None  # then the cached one is evicted
    assert prefix_hashes([1, 2, 3, 4], 2, 2)[1] != prefix_hashes([9, 2, 3, 4], 2, 2)[1]  # hashes chain


def _engine(model, **kwargs) -> RolloutEngine:
    return RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=2048, prefix_caching=True, **kwargs))


def _plain(model, prompts, params=GREEDY) -> list[list[int]]:
    """The engine without the prefix cache (itself checked against HF generate elsewhere; HF's
    generate cannot be the reference here: it masks pad-id tokens that completions may contain)."""
    engine = RolloutEngine(model, RolloutConfig(block_size=4, kv_cache_tokens=2048))
    return [o.completion_ids for o in engine.generate(prompts, params)]


def test_continuations_reuse_the_cached_prefix_and_match_hf(arch_model):
    engine = _engine(arch_model)
    prompts = random_prompts(3, seed=31, min_len=9, max_len=14)
    first = engine.generate(prompts, GREEDY)
    turn2 = [p + o.completion_ids + [5, 6, 7] for p, o in zip(prompts, first)]
    before = engine.stats.prefill_tokens
    second = engine.generate(turn2, GREEDY)
    assert engine.stats.prefix_hit_tokens >= sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert engine.stats.prefill_tokens - before < sum(map(len, turn2)) - engine.stats.prefix_hit_tokens + 1
    assert [o.completion_ids for o in first] == [hf_greedy(arch_model, p, 10) for p in prompts]
    assert [o.completion_ids for o in second] == _plain(arch_model, turn2)


def test_scored_span_is_computed_even_when_cached(arch_model):
    engine = _engine(arch_model)
    prompt = random_prompts(1, seed=32, min_len=16, max_len=16)[0]
    engine.generate([prompt], GREEDY)
    out = engine.generate([prompt + [8, 9]], SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=10))[0]
    with torch.no_grad():
        logits = arch_model(torch.tensor([prompt + [8, 9]])).logits[0].float()
    ids = torch.tensor(prompt + [8, 9])
    want = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)[-10:]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=1e-4, rtol=1e-4)
    assert engine.stats.prefix_hit_tokens == 4  # only the block before the scored span


def test_changed_weights_drop_the_cache():
    model = cached_model("llama", seed=7)
    model = type(model)(model.config).eval()
    model.load_state_dict(cached_model("llama", seed=7).state_dict())
    engine = _engine(model)
    prompt = random_prompts(1, seed=33, min_len=12, max_len=12)[0]
    engine.generate([prompt], GREEDY)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)  # an optimizer step, in place
    out = engine.generate([prompt + [3]], GREEDY)[0]
    assert engine.stats.prefix_hit_tokens == 0
    assert out.completion_ids == _plain(model, [prompt + [3]])[0]
    engine.generate([prompt + [3]], GREEDY)  # unchanged weights: now it hits
    assert engine.stats.prefix_hit_tokens == 12


def test_preemption_with_prefix_caching_keeps_outputs(arch_model):
    prompts = random_prompts(6, seed=34, min_len=6, max_len=12)
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=14, prefix_caching=True))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    again = engine.generate([p + o.completion_ids[:5] for p, o in zip(prompts, outs)], GREEDY)
    assert engine.stats.preemptions > 0
    assert [o.completion_ids for o in outs] == [hf_greedy(arch_model, p, 16, eos_id=-1) for p in prompts]
    assert [a.completion_ids for a in again] == _plain(
        arch_model, [p + o.completion_ids[:5] for p, o in zip(prompts, outs)]
    )


def test_prefix_caching_is_refused_with_a_model_drafter(arch_model):
    with pytest.raises(ValueError, match="prefix_caching"):
        RolloutEngine(arch_model, RolloutConfig(prefix_caching=True), drafter=cached_model("qwen2", seed=9))
    with pytest.raises(ValueError, match="prefix_caching"):
        RolloutConfig(prefix_caching=1)
