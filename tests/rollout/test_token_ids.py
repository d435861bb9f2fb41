"""Token ids in every integer form users hand over are accepted alike; floats, bools and text are
refused with a message that says the type is wrong (not that the id is out of the vocabulary)."""

import numpy as np
import pytest
import torch
from rollout_helpers import cached_model, hf_greedy, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.token_ids import token_id_list

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.mark.parametrize(
    "ids",
    [
        [3, 4, 5],
        (3, 4, 5),
        [np.int64(3), np.int32(4), np.uint8(5)],
        np.array([3, 4, 5]),
        np.array([3, 4, 5], dtype=np.int16),
        torch.tensor([3, 4, 5]),
        torch.tensor([3, 4, 5], dtype=torch.int32),
        [torch.tensor(3), 4, np.array(5)],
    ],
)
def test_integer_like_ids_become_a_list_of_ints(ids):
    out = token_id_list(ids)
    assert out == [3, 4, 5] and all(type(t) is int for t in out)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([3, 4.0], r"prompt_ids\[1\] = 4.0 has type float; token ids must be integers"),
        ([3, np.float32(4)], r"prompt_ids\[1\] .* has type float32"),
        ([True, 4], r"prompt_ids\[0\] = True is a bool"),
        ([3, np.bool_(True)], r"prompt_ids\[1\] .* is a bool"),
        (np.array([3.0, 4.0]), "array of dtype float64; token ids must be integers"),
        (torch.tensor([3.0, 4.0]), "tensor of dtype torch.float32; token ids must be integers"),
        (torch.tensor([True, False]), "tensor of dtype torch.bool"),
        (np.array([[3, 4]]), "must be 1-D, got a 2-D array"),
        ([torch.tensor(3.0)], r"prompt_ids\[0\] .* torch.float32 scalar"),
        ("3 4 5", "is text"),
        (7, "must be a sequence of token ids, got int"),
        ([3, "4"], r"prompt_ids\[1\] = '4' has type str"),
    ],
)
def test_non_integer_ids_are_refused_for_their_type(ids, match):
    with pytest.raises(ValueError, match=match):
        token_id_list(ids)


def test_stop_token_ids_accept_numpy_integers():
    assert SamplingParams(stop_token_ids=np.array([4, 5])).stop_token_ids == (4, 5)
    assert SamplingParams(stop_token_ids=[np.int64(4)]).stop_token_ids == (4,)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[4.0])


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(cached_model("qwen2"), RolloutConfig(block_size=4, num_blocks=40, max_model_len=64))


def test_the_engine_serves_numpy_and_tensor_prompts_like_lists(engine):
    prompts = random_prompts(3, seed=21, max_len=10)
    forms = [np.array(prompts[0]), [np.int64(t) for t in prompts[1]], torch.tensor(prompts[2])]
    outputs = engine.generate(forms, GREEDY)
    assert [o.prompt_ids for o in outputs] == prompts
    assert [o.completion_ids for o in outputs] == [hf_greedy(engine.model, p, 8) for p in prompts]
    rid = engine.add_request(np.array(prompts[0], dtype=np.int32), GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output(rid).completion_ids == outputs[0].completion_ids


def test_a_float_prompt_is_refused_by_type_and_nothing_runs(engine):
    good = random_prompts(2, seed=22, max_len=10)
    with pytest.raises(ValueError, match=r"request 1: prompt_ids\[0\] = 3.0 has type float"):
        engine.generate([good[0], [3.0, 4.0], good[1]], GREEDY)
    assert not engine.has_unfinished()
