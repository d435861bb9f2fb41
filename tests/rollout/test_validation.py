"""Bad input gets a clear ValueError and never disturbs the requests already running."""

import math

import pytest
from rollout_helpers import VOCAB, cached_model, hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(max_new_tokens=8.0), "max_new_tokens"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(seed="x"), "seed"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(strategy="magic"), "strategy"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_model_len=1), "max_model_len"),
    ],
)
def test_rollout_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RolloutConfig(**kwargs)
    with pytest.raises(ValueError, match="blok_size is not a field of RolloutConfig"):
        RolloutConfig.from_dict({"block_size": 4, "blok_size": 4})


@pytest.fixture
def engine():
    return RolloutEngine(cached_model("qwen2"), RolloutConfig(block_size=4, num_blocks=40, max_model_len=64))


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ([5] * 70, GREEDY, "max_model_len"),
        ([5, VOCAB, 7], GREEDY, r"prompt_ids\[1\]"),
        ([5, -1], GREEDY, r"prompt_ids\[1\]"),
        ([5, "a"], GREEDY, r"prompt_ids\[1\]"),
        ([5, 6], GREEDY.with_updates(stop_token_ids=(VOCAB + 3,)), "stop_token_ids"),
        ([5] * 60, GREEDY, "exceeds the context"),
        ([5, 6], "greedy", "SamplingParams"),
    ],
)
def test_bad_requests_are_refused(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_request_larger_than_the_kv_pool_is_refused():
    small = RolloutEngine(cached_model("qwen2"), RolloutConfig(block_size=4, num_blocks=3))
    with pytest.raises(ValueError, match="KV blocks"):
        small.add_request([5] * 10, GREEDY)


def test_engine_keeps_serving_after_bad_input(engine):
    model = engine.model
    good = random_prompts(3, seed=11, max_len=12)
    ids = [engine.add_request(p, GREEDY) for p in good]
    engine.step()
    engine.step()
    for bad in ([], [VOCAB + 1], [5] * 100):
        with pytest.raises(ValueError):
            engine.add_request(bad, GREEDY)
    while engine.has_unfinished():
        engine.step()
    for i, p in zip(ids, good):
        assert engine.pop_output(i).completion_ids == hf_greedy(model, p, 16)


def test_generate_validates_everything_before_submitting(engine):
    good = random_prompts(3, seed=12, max_len=12)
    with pytest.raises(ValueError, match=r"request 1: .*prompt_ids\[0\]"):
        engine.generate([good[0], [VOCAB + 5], good[2]], GREEDY)
    assert not engine.has_unfinished()
    outputs = engine.generate(good, GREEDY)
    assert [o.completion_ids for o in outputs] == [hf_greedy(engine.model, p, 16) for p in good]
    with pytest.raises(ValueError, match="SamplingParams for"):
        engine.generate(good, [GREEDY])
