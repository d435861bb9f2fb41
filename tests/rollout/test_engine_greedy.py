"""Greedy fp32 output of the engine equals Hugging Face generate token for token.

Every scheduling path (ragged prefill, decode, preemption and recompute, forked prompt groups,
step-wise submission, any block size) must be invisible in the output.
"""

import pytest
import torch
from rollout_helpers import EOS, cached_model, hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.kv_cache import blocks_for
from tailspec.testing import ARCHITECTURES

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)

_hf_cache: dict = {}


def hf_reference(model, prompt, max_new_tokens=MAX_NEW, eos_id=EOS):
    """``hf_greedy``, memoized: prompt groups and repeated configs reuse one HF generate per prompt."""
    key = (id(model), tuple(prompt), max_new_tokens, eos_id)
    if key not in _hf_cache:
        _hf_cache[key] = hf_greedy(model, prompt, max_new_tokens, eos_id)
    return _hf_cache[key]


def _check_against_hf(model, prompts, outputs, max_new_tokens=MAX_NEW):
    assert len(outputs) == len(prompts)
    for p, o in zip(prompts, outputs):
        ref = hf_reference(model, p, max_new_tokens)
        assert o.prompt_ids == p
        assert o.completion_ids == ref
        assert len(o.logprobs) == len(o.completion_ids)
        assert o.finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert EOS not in o.completion_ids[:-1]
        if o.finish_reason == "length":
            assert len(o.completion_ids) == max_new_tokens


def _all_blocks_free(engine):
    alloc = engine.runner.cache.allocator
    return alloc.num_free == alloc.num_blocks and all(alloc.refcount(b) == 0 for b in range(alloc.num_blocks))


def test_ragged_batch_matches_hf(arch_model):
    g = torch.Generator().manual_seed(100)
    prompts = random_prompts(8, seed=0) + [[int(torch.randint(2, 96, (1,), generator=g))], list(range(30, 55))]
    assert {1, 25} <= {len(p) for p in prompts}
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=256))
    outputs = engine.generate(prompts, GREEDY)
    _check_against_hf(arch_model, prompts, outputs)
    assert engine.stats.preemptions == 0 and _all_blocks_free(engine)
    # a greedy token's logprob is its log-probability under the raw (unscaled, unfiltered) softmax
    with torch.no_grad():
        for o in outputs:
            logits = arch_model(torch.tensor([o.prompt_ids + o.completion_ids])).logits[0]
            ref = torch.log_softmax(logits[len(o.prompt_ids) - 1 : -1].float(), -1)
            ref = ref.gather(-1, torch.tensor(o.completion_ids).unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-4)


def test_eos_ends_the_sequence_and_is_kept(arch_model):
    """Use a token the model actually emits as EOS, so both ways of finishing are exercised."""
    prompts = random_prompts(8, seed=7)
    free_running = [hf_reference(arch_model, p, MAX_NEW, eos_id=-1) for p in prompts]
    counts = {}
    for row in free_running:
        for t in row[1:12]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=256), eos_token_ids=[eos])
    outputs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outputs):
        ref = hf_reference(arch_model, p, MAX_NEW, eos_id=eos)
        assert o.completion_ids == ref
        assert o.finish_reason == ("stop" if ref[-1] == eos else "length")
    assert {o.finish_reason for o in outputs} == {"stop", "length"}


def test_eos_inside_the_prompt_does_not_stop_generation():
    model = cached_model("llama")
    prompts = [[5, EOS, 9, 14], [20, 21, EOS], [EOS]]
    outputs = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=64)).generate(prompts, GREEDY)
    _check_against_hf(model, prompts, outputs)
    assert all(len(o.completion_ids) >= 1 for o in outputs)


def test_forced_preemption_matches_hf(arch_model):
    prompts = random_prompts(10, seed=1)
    longest = max(len(p) for p in prompts) + MAX_NEW
    num_blocks = blocks_for(longest, 4) + 2  # the largest request fits, a few together do not
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=num_blocks))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.stats.preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == engine.stats.preemptions
    assert any(o.num_preemptions > 0 for o in outputs)
    _check_against_hf(arch_model, prompts, outputs)
    assert _all_blocks_free(engine)


def _group_base(seed):
    """Three distinct prompts: two whose length is not a multiple of 4, one of exactly 2 blocks."""
    base = random_prompts(2, seed=seed, min_len=5, max_len=7) + [list(range(2, 10))]
    assert [len(p) % 4 != 0 for p in base] == [True, True, False]
    return base


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_prompt_groups_are_forked_and_match_hf(arch_model, layout):
    base = _group_base(seed=2)
    if layout == "contiguous":
        prompts = [p for p in base for _ in range(4)]
    else:
        prompts = [p for _ in range(4) for p in base]
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=128))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.stats.forked_prefills == 9  # 3 groups of 4: one leader prefilled, 3 forks each
    assert engine.stats.prefill_tokens == sum(len(p) for p in base)  # each prompt prefilled once
    _check_against_hf(arch_model, prompts, outputs)
    for p in base:
        copies = [o.completion_ids for o in outputs if o.prompt_ids == p]
        assert len(copies) == 4 and all(c == copies[0] for c in copies)
    assert _all_blocks_free(engine)


def test_prompt_groups_under_preemption_match_hf(arch_model):
    """Forked members share prefix blocks; preempting and recomputing them must not corrupt anyone."""
    base = _group_base(seed=3)
    prompts = [p for _ in range(3) for p in base] + random_prompts(2, seed=4, max_len=10)
    longest = max(len(p) for p in prompts) + MAX_NEW
    engine = RolloutEngine(arch_model, RolloutConfig(block_size=4, num_blocks=blocks_for(longest, 4) + 1))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.stats.preemptions > 0 and engine.stats.forked_prefills > 0
    _check_against_hf(arch_model, prompts, outputs)
    assert _all_blocks_free(engine)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_block_size_does_not_change_outputs(arch):
    model = cached_model(arch)
    prompts = random_prompts(3, seed=3) + [list(range(40, 56)), list(range(60, 77))]  # 16 and 17 tokens
    results = []
    for bs in (1, 3, 16):
        outputs = RolloutEngine(model, RolloutConfig(block_size=bs, kv_cache_tokens=4096)).generate(prompts, GREEDY)
        results.append([o.completion_ids for o in outputs])
    assert results[0] == results[1] == results[2]
    assert results[0] == [hf_reference(model, p) for p in prompts]


@pytest.mark.parametrize(
    "limits",
    [dict(max_num_seqs=2), dict(max_prefill_tokens=5), dict(max_num_seqs=3, max_prefill_tokens=9)],
    ids=["max_num_seqs", "max_prefill_tokens", "both"],
)
def test_scheduler_limits_do_not_change_outputs(limits):
    model = cached_model("qwen2")
    base = _group_base(seed=5)
    prompts = [p for _ in range(3) for p in base] + random_prompts(3, seed=6)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=128, **limits))
    outputs = engine.generate(prompts, GREEDY)
    _check_against_hf(model, prompts, outputs)
    if "max_num_seqs" in limits:
        assert max(engine.stats.batch_sizes) <= limits["max_num_seqs"]
    assert _all_blocks_free(engine)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_stepwise_submission_while_running(arch):
    model = cached_model(arch)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=256))
    first, second = random_prompts(3, seed=4), random_prompts(3, seed=5)
    ids = [engine.add_request(p, GREEDY) for p in first]
    finished = []
    for _ in range(5):
        finished += engine.step()
    assert engine.has_unfinished()
    ids += [engine.add_request(p, GREEDY) for p in second + [first[0]]]  # incl. a prompt already running
    while engine.has_unfinished():
        finished += engine.step()
    assert sorted(finished) == sorted(ids)
    outputs = [engine.pop_output(i) for i in ids]
    _check_against_hf(model, first + second + [first[0]], outputs)
    assert engine.step() == []  # idle engine: nothing to do


def test_greedy_rows_are_unaffected_by_sampled_neighbours():
    model = cached_model("qwen2")
    prompts = random_prompts(6, seed=8)
    sampled = SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=MAX_NEW)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(prompts))]
    outputs = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=128)).generate(prompts, params)
    greedy = [(p, o) for p, o, sp in zip(prompts, outputs, params) if sp.greedy]
    _check_against_hf(model, [p for p, _ in greedy], [o for _, o in greedy])


def test_max_new_tokens_and_stop_ids_are_respected():
    model = cached_model("qwen3")
    prompt = random_prompts(1, seed=6)[0]
    ref = hf_reference(model, prompt)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=64))
    short = engine.generate([prompt], GREEDY.with_updates(max_new_tokens=3))[0]
    assert short.completion_ids == ref[:3] and short.finish_reason in ("length", "stop")
    stop_at = ref[2]
    stopped = engine.generate([prompt], GREEDY.with_updates(stop_token_ids=(stop_at,)))[0]
    assert stopped.completion_ids == ref[: ref.index(stop_at) + 1] and stopped.finish_reason == "stop"
    ignoring = engine.generate([prompt], GREEDY.with_updates(ignore_eos=True, max_new_tokens=30))[0]
    assert len(ignoring.completion_ids) == 30 and ignoring.finish_reason == "length"
    assert ignoring.completion_ids == hf_reference(model, prompt, 30, eos_id=-1)


def test_generate_stream_hands_over_requests_as_they_finish_and_aborts_the_rest():
    model = cached_model("qwen2")
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=64))
    short, long_ = SamplingParams(temperature=0.0, max_new_tokens=2), SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = random_prompts(3, seed=31, max_len=8)
    stream = engine.generate_stream(prompts, [long_, short, long_])
    first = next(stream)
    assert [i for i, _ in first] == [1] and first[0][1].completion_ids == hf_greedy(model, prompts[1], 2)
    stream.close()  # the caller stops listening: what was left is aborted, nothing stays behind
    assert not engine.has_unfinished()
    assert [o.completion_ids for o in engine.generate(prompts, long_)] == [hf_greedy(model, p, 12) for p in prompts]
