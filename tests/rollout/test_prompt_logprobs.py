"""Prompt log-probabilities: one prefill scores the last n prompt tokens, exactly as a plain forward."""

import pytest
import torch
from rollout_helpers import random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams


def reference_prompt_logprobs(model, prompt: list[int], n: int) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(prompt[1:])
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[len(prompt) - 1 - n :].tolist()


def test_prompt_logprobs_match_a_plain_forward(arch_model):
    prompts = random_prompts(6, seed=3, min_len=4, max_len=30)
    spans = [len(prompts[0]) - 1, 1, 3, 0, 2, len(prompts[5]) // 2]
    params = [SamplingParams(temperature=0.0, max_new_tokens=3, prompt_logprobs=n) for n in spans]
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=1024))
    outputs = engine.generate(prompts, params)
    for prompt, n, out in zip(prompts, spans, outputs):
        if n == 0:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == n
        torch.testing.assert_close(
            torch.tensor(out.prompt_logprobs),
            torch.tensor(reference_prompt_logprobs(arch_model, prompt, n)),
            atol=1e-4,
            rtol=1e-4,
        )


def test_prompt_group_members_get_their_own_span(arch_model):
    prompt = random_prompts(1, seed=5, min_len=12, max_len=12)[0]
    spans = [2, 7, 0, 5]
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=4, prompt_logprobs=n) for i, n in enumerate(spans)]
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=1024))
    outputs = engine.generate([prompt] * 4, params)
    assert engine.stats.forked_prefills == 3
    full = reference_prompt_logprobs(arch_model, prompt, 7)
    for n, out in zip(spans, outputs):
        if n:
            torch.testing.assert_close(
                torch.tensor(out.prompt_logprobs), torch.tensor(full[7 - n :]), atol=1e-4, rtol=1e-4
            )
        else:
            assert out.prompt_logprobs is None


def test_scoring_does_not_change_generation(arch_model):
    prompts = random_prompts(4, seed=8, min_len=5, max_len=20)
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=1024))
    plain = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    scored = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6, prompt_logprobs=3))
    assert [o.completion_ids for o in plain] == [o.completion_ids for o in scored]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_prompt_logprobs_is_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_span_must_be_shorter_than_the_prompt(arch_model):
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, kv_cache_tokens=256))
    with pytest.raises(ValueError, match="prompt_logprobs = 3 must be smaller than the prompt length 3"):
        engine.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=3))


def test_preempted_requests_keep_their_prompt_logprobs(arch_model):
    prompts = random_prompts(8, seed=11, min_len=6, max_len=14)
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=24))
    outputs = engine.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, prompt_logprobs=4)
    )
    assert engine.stats.preemptions > 0
    for prompt, out in zip(prompts, outputs):
        torch.testing.assert_close(
            torch.tensor(out.prompt_logprobs),
            torch.tensor(reference_prompt_logprobs(arch_model, prompt, 4)),
            atol=1e-4,
            rtol=1e-4,
        )
