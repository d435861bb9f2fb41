"""Parameter edge cases, request limits at their exact boundaries, and the engine's state after
refused, aborted or unfinished requests. (The basic bad-value tables are in test_validation.py.)"""

import pytest
import torch
from rollout_helpers import EOS, VOCAB, cached_model, hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.kv_cache import blocks_for

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=float("nan")), r"top_p must be in \(0, 1\], got nan"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(min_p=2), r"min_p must be in \[0, 1\], got 2"),
        (dict(temperature=True), "temperature"),
        (dict(temperature="1.0"), "temperature"),
        (dict(top_k=True), "top_k"),
        (dict(top_k=4.0), "top_k"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(max_new_tokens="8"), "max_new_tokens"),
        (dict(stop_token_ids=5), "stop_token_ids"),  # a bare int, not a sequence
        (dict(stop_token_ids=(3, "4")), "stop_token_ids"),
        (dict(stop_token_ids=(True,)), "stop_token_ids"),
        (dict(seed=2**64), "seed"),  # beyond what torch.Generator accepts
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=True), "seed"),
    ],
)
def test_sampling_params_edge_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_boundary_values_are_accepted():
    for kwargs in [
        dict(temperature=0),
        dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
        dict(min_p=1.0, top_p=1e-9, top_k=10**9),
        dict(max_new_tokens=1),
        dict(seed=-(2**63)),
        dict(seed=2**64 - 1),
        dict(stop_token_ids=[]),
        dict(stop_token_ids=range(3)),
    ]:
        SamplingParams(**kwargs)
    p = SamplingParams(stop_token_ids=[4, 5])
    assert p.stop_token_ids == (4, 5)
    assert hash(p) == hash(SamplingParams(stop_token_ids=(4, 5)))  # frozen and hashable
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-6).greedy
    with pytest.raises(ValueError, match="temperature"):
        p.with_updates(temperature=-1.0)  # updates are validated too
    with pytest.raises(TypeError):
        SamplingParams(temprature=1.0)  # a misspelt field is not silently ignored


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=1025), "block_size"),
        (dict(block_size=4.0), "block_size"),
        (dict(num_blocks=-1), "num_blocks"),
        (dict(num_blocks=2.0), "num_blocks"),
        (dict(block_size=32, kv_cache_tokens=16), r"kv_cache_tokens must be an int >= block_size \(32\)"),
        (dict(max_prefill_tokens=0), "max_prefill_tokens"),
        (dict(max_model_len=2.5), "max_model_len"),
        (dict(strategy=""), "strategy"),
        (dict(seed="0"), "seed"),
        (dict(seed=2**64), "seed"),
    ],
)
def test_rollout_config_edge_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_rollout_config_from_dict_and_sizing():
    cfg = RolloutConfig.from_dict({"block_size": 8, "kv_cache_tokens": 100, "seed": 3})
    assert (cfg.block_size, cfg.total_blocks, cfg.seed) == (8, 12, 3)
    assert RolloutConfig(block_size=8, num_blocks=5, kv_cache_tokens=100).total_blocks == 5
    with pytest.raises(ValueError, match="blok_size is not a field of RolloutConfig; its fields: block_size"):
        RolloutConfig.from_dict({"blok_size": 4, "zzz": 1})
    with pytest.raises(ValueError, match="block_size"):
        RolloutConfig.from_dict({"block_size": 0})


def test_eos_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="eos_token_ids"):
        RolloutEngine(cached_model("qwen2"), RolloutConfig(num_blocks=8), eos_token_ids=[VOCAB])
    with pytest.raises(ValueError, match="eos_token_ids"):
        RolloutEngine(cached_model("qwen2"), RolloutConfig(num_blocks=8), eos_token_ids=[-1])


def test_limits_hold_exactly_at_the_boundary():
    model = cached_model("qwen2")
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    # context: prompt + max_new_tokens == max_model_len is allowed, one more token is not
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=64, max_model_len=20))
    out = engine.generate([list(range(2, 16))], params)[0]
    assert len(out.completion_ids) == 6
    with pytest.raises(ValueError, match="max_model_len = 20"):
        engine.add_request(list(range(2, 17)), params)
    # KV pool: a request that needs exactly every block is allowed (and runs), one more token is not
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=3))
    out = engine.generate([list(range(2, 8))], params)[0]  # 6 + 6 = 12 tokens = 3 blocks
    assert out.completion_ids == hf_greedy(model, list(range(2, 8)), 6, eos_id=-1)
    with pytest.raises(ValueError, match="needs 4 KV blocks but the pool has 3"):
        engine.add_request(list(range(2, 9)), params)
    # two requests that each need the whole pool run one after the other (preempting if needed)
    outs = engine.generate([list(range(2, 8)), list(range(20, 26))], params)
    assert [o.completion_ids for o in outs] == [
        hf_greedy(model, p, 6, eos_id=-1) for p in (list(range(2, 8)), list(range(20, 26)))
    ]
    assert engine.runner.cache.allocator.num_free == 3


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([5, 6, -1], r"prompt_ids\[2\] = -1"),
        ([5, 6, VOCAB], rf"prompt_ids\[2\] = {VOCAB}"),
        ([True, 6], r"prompt_ids\[0\] = True"),
        ([5, 6.0], r"prompt_ids\[1\] = 6.0"),
    ],
)
def test_token_ids_are_checked(prompt, match):
    engine = RolloutEngine(cached_model("llama"), RolloutConfig(block_size=4, num_blocks=32))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, GREEDY)
    assert not engine.has_unfinished()


def test_tensor_prompts_are_accepted():
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=32))
    prompt = [7, 8, 9, 10, 11]
    out = engine.generate([torch.tensor(prompt)], GREEDY)[0]
    assert out.prompt_ids == prompt and out.completion_ids == hf_greedy(model, prompt, MAX_NEW)


def test_generate_names_every_bad_request_and_submits_nothing():
    model = cached_model("qwen2")
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=10))  # 40 tokens
    good = random_prompts(3, seed=13, max_len=10)
    bad = [[-4], good[0], [5] * 30, good[1]]  # -4: not a token; 30 + 16 tokens: more than the pool
    with pytest.raises(ValueError) as err:
        engine.generate(bad, GREEDY)
    message = str(err.value)
    assert "request 0: prompt_ids[0] = -4" in message and "request 2:" in message and "KV blocks" in message
    assert "request 1" not in message and "request 3" not in message
    assert not engine.has_unfinished() and engine.stats.steps == 0
    outputs = engine.generate(good, GREEDY)
    assert [o.completion_ids for o in outputs] == [hf_greedy(model, p, MAX_NEW) for p in good]


def test_refused_requests_do_not_disturb_a_preempting_batch():
    model = cached_model("qwen3")
    good = random_prompts(5, seed=14, max_len=10)
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=blocks_for(10 + MAX_NEW, 4) + 1))
    ids = [engine.add_request(p, GREEDY) for p in good]
    for _ in range(3):
        engine.step()
    bad_requests = [
        ([], GREEDY, "empty"),
        ([5, VOCAB + 1], GREEDY, "vocabulary"),
        ([5, 6], GREEDY.with_updates(stop_token_ids=(VOCAB,)), "stop_token_ids"),
        ([5] * 20, GREEDY, "KV blocks"),
        ([5] * 600, GREEDY, "max_model_len"),
    ]
    for prompt, params, match in bad_requests:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.preemptions > 0
    assert [engine.pop_output(i).completion_ids for i in ids] == [hf_greedy(model, p, MAX_NEW) for p in good]
    assert engine.runner.cache.allocator.num_free == engine.runner.cache.num_blocks


def test_pop_output_of_an_unfinished_request_keeps_it():
    model = cached_model("llama")
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=32))
    prompt = [5, 6, 7]
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=f"request {rid} has not finished"):
        engine.pop_output(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output(rid).completion_ids == hf_greedy(model, prompt, MAX_NEW)


def test_abort_frees_blocks_and_leaves_the_others_intact():
    """Abort a waiting request, a running one and a forked group member sharing prefix blocks."""
    model = cached_model("qwen2")
    engine = RolloutEngine(model, RolloutConfig(block_size=4, num_blocks=64, max_num_seqs=6))
    shared = [9, 10, 11, 12, 13, 14]  # 1 full block shared by the group, a private partial one each
    group = engine.new_group()
    members = [engine.add_request(shared, GREEDY, group=group) for _ in range(3)]
    others = [engine.add_request(p, GREEDY) for p in random_prompts(3, seed=15, max_len=8)]
    queued = [engine.add_request([40 + i], GREEDY) for i in range(2)]  # beyond max_num_seqs: waiting
    engine.step()
    engine.step()
    assert engine.stats.forked_prefills == 2
    engine.abort(members[1])
    engine.abort(others[0])
    engine.abort(queued[0])
    engine.abort(queued[0])  # aborting twice is harmless
    while engine.has_unfinished():
        engine.step()
    for rid in (members[1], others[0], queued[0]):
        assert engine.pop_output(rid).finish_reason == "abort"
    for rid in (members[0], members[2]):
        assert engine.pop_output(rid).completion_ids == hf_greedy(model, shared, MAX_NEW)
    for rid in others[1:] + queued[1:]:
        out = engine.pop_output(rid)
        assert out.completion_ids == hf_greedy(model, out.prompt_ids, MAX_NEW)
        assert out.finish_reason == ("stop" if out.completion_ids[-1] == EOS else "length")
    assert engine.runner.cache.allocator.num_free == 64
