"""Greedy fp32 output of the engine equals Hugging Face generate token for token."""

import pytest
from conftest import EOS, cached_model, hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def _check_against_hf(model, prompts, outputs, max_new_tokens=24):
    for p, o in zip(prompts, outputs):
        ref = hf_greedy(model, p, max_new_tokens)
        assert o.prompt_ids == p
        assert o.completion_ids == ref
        assert len(o.logprobs) == len(o.completion_ids)
        assert o.finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert EOS not in o.completion_ids[:-1]


def test_ragged_batch_matches_hf(arch_model):
    prompts = random_prompts(10, seed=0)
    outputs = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=256)).generate(prompts, GREEDY)
    _check_against_hf(arch_model, prompts, outputs)


def test_eos_ends_the_sequence_and_is_kept(arch_model):
    """Use a token the model actually emits as EOS, so both ways of finishing are exercised."""
    prompts = random_prompts(8, seed=7)
    free_running = [hf_greedy(arch_model, p, 24, eos_id=-1) for p in prompts]
    counts = {}
    for row in free_running:
        for t in row[1:12]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=256), eos_token_ids=[eos])
    outputs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outputs):
        ref = hf_greedy(arch_model, p, 24, eos_id=eos)
        assert o.completion_ids == ref
        assert o.finish_reason == ("stop" if ref[-1] == eos else "length")
    assert "stop" in {o.finish_reason for o in outputs}


def test_forced_preemption_matches_hf(arch_model):
    prompts = random_prompts(10, seed=1)
    longest = max(len(p) for p in prompts) + GREEDY.max_new_tokens
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=-(-longest // 4) + 2))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.stats.preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == engine.stats.preemptions
    _check_against_hf(arch_model, prompts, outputs)
    assert engine.runner.cache.allocator.num_free == engine.runner.cache.num_blocks


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_prompt_groups_are_forked_and_match_hf(arch_model, layout):
    base = random_prompts(2, seed=2, min_len=5, max_len=7) + [list(range(2, 10))]  # 8 tokens = 2 full blocks
    if layout == "contiguous":
        prompts = [p for p in base for _ in range(4)]
    else:
        prompts = [p for _ in range(4) for p in base]
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=128))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.stats.forked_prefills == 9
    assert engine.stats.prefill_tokens == sum(len(p) for p in base)  # each prompt prefilled once
    _check_against_hf(arch_model, prompts, outputs)
    assert engine.runner.cache.allocator.num_free == 128


def test_block_size_does_not_change_outputs():
    model = cached_model("qwen2")
    prompts = random_prompts(6, seed=3)
    results = [
        [
            o.completion_ids
            for o in RolloutEngine(model, RolloutConfig(block_size=bs, kv_cache_tokens=4096)).generate(prompts, GREEDY)
        ]
        for bs in (1, 3, 16)
    ]
    assert results[0] == results[1] == results[2]


def test_stepwise_submission_while_running():
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=256))
    first, second = random_prompts(4, seed=4), random_prompts(4, seed=5)
    ids = [engine.add_request(p, GREEDY) for p in first]
    for _ in range(5):
        engine.step()
    ids += [engine.add_request(p, GREEDY) for p in second]
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.pop_output(i) for i in ids]
    _check_against_hf(model, first + second, outputs)


def test_max_new_tokens_and_stop_ids_are_respected():
    model = cached_model("qwen3")
    prompt = random_prompts(1, seed=6)[0]
    ref = hf_greedy(model, prompt, 24)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=64))
    short = engine.generate([prompt], GREEDY.with_updates(max_new_tokens=3))[0]
    assert short.completion_ids == ref[:3] and short.finish_reason in ("length", "stop")
    stop_at = ref[2]
    stopped = engine.generate([prompt], GREEDY.with_updates(stop_token_ids=(stop_at,)))[0]
    assert stopped.completion_ids == ref[: ref.index(stop_at) + 1] and stopped.finish_reason == "stop"
    ignoring = engine.generate([prompt], GREEDY.with_updates(ignore_eos=True, max_new_tokens=30))[0]
    assert len(ignoring.completion_ids) == 30
