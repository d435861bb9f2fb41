"""RolloutConfig.mixed_batches: prompts admitted mid-run join the running decode in one forward."""

import pytest
from rollout_helpers import hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams


def _staggered(engine: RolloutEngine, prompts, params, every: int = 2) -> dict[int, list[int]]:
    """Submit one prompt every ``every`` steps while the others decode; completions by prompt index."""
    ids: dict[int, int] = {}
    outputs: dict[int, list[int]] = {}
    step = 0
    while len(outputs) < len(prompts):
        if len(ids) < len(prompts) and step % every == 0:
            ids[engine.add_request(prompts[len(ids)], params)] = len(ids)
        for rid in engine.step():
            outputs[ids[rid]] = engine.pop_output(rid).completion_ids
        step += 1
    return outputs


@pytest.mark.parametrize("num_blocks", [None, 12])
def test_mixed_steps_are_greedy_identical_to_plain_decoding(arch_model, num_blocks):
    prompts = random_prompts(6, seed=21, min_len=3, max_len=12)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    config = RolloutConfig(block_size=4, num_blocks=num_blocks, kv_cache_tokens=2048, mixed_batches=True)
    engine = RolloutEngine(arch_model, config)
    got = _staggered(engine, prompts, params)
    assert engine.stats.mixed_steps > 0
    if num_blocks:
        assert engine.stats.preemptions > 0
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(arch_model, prompt, 16), i


def test_mixed_steps_keep_seeded_samples(arch_model):
    prompts = random_prompts(5, seed=22, min_len=3, max_len=10)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_new_tokens=12, prompt_logprobs=2) for i in range(5)]
    plain = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=2048)).generate(prompts, params)
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=2048, mixed_batches=True))
    ids = {}
    outputs = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ids[engine.add_request(p, sp)] = i
        for rid in engine.step():
            outputs[ids[rid]] = engine.pop_output(rid)
    while engine.has_unfinished():
        for rid in engine.step():
            outputs[ids[rid]] = engine.pop_output(rid)
    assert engine.stats.mixed_steps > 0
    for i, out in enumerate(plain):
        assert outputs[i].completion_ids == out.completion_ids
        assert outputs[i].prompt_logprobs == pytest.approx(out.prompt_logprobs, abs=1e-5)


def test_speculative_strategies_do_not_mix(arch_model):
    engine = RolloutEngine(
        arch_model, RolloutConfig(block_size=4, kv_cache_tokens=2048, mixed_batches=True, strategy="suffix")
    )
    _staggered(
        engine, random_prompts(4, seed=23, min_len=3, max_len=8), SamplingParams(temperature=0.0, max_new_tokens=8)
    )
    assert engine.stats.mixed_steps == 0


def test_mixed_batches_must_be_a_bool():
    with pytest.raises(ValueError, match="mixed_batches"):
        RolloutConfig(mixed_batches="yes")
