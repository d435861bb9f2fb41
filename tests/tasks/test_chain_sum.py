import random
import statistics

import pytest

from tailspec.tasks.chain_sum import (
    ChainSumConfig,
    ChainSumProblem,
    chain_sum_reward,
    extract_answer,
    make_grpo_dataset,
    sample_problem,
    sample_problems,
)


def test_problem_format():
    p = ChainSumProblem((3, 5, 2, 7))
    assert p.question == "add 3 5 2 7"
    assert p.solution == "3+5=8 8+2=10 10+7=17 answer 17"
    assert p.answer == 17 == extract_answer(p.solution)


def test_sampling_is_deterministic_and_in_range():
    cfg = ChainSumConfig(min_terms=2, max_terms=12)
    a, b = sample_problems(200, seed=5, cfg=cfg), sample_problems(200, seed=5, cfg=cfg)
    assert a == b
    assert all(2 <= len(p.terms) <= 12 and all(0 <= t <= 9 for t in p.terms) for p in a)
    assert sample_problem(random.Random(0), cfg, num_terms=7).terms.__len__() == 7


def test_solution_lengths_are_heavy_tailed():
    lengths = sorted(len(p.solution) for p in sample_problems(2000, seed=1))
    median = statistics.median(lengths)
    assert lengths[int(0.99 * len(lengths))] >= 10 * median
    assert lengths[int(0.95 * len(lengths))] >= 5 * median
    assert median <= 40


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1+2=3 answer 3", 3),
        ("answer 4 then answer 12", 12),
        ("no result", None),
        ("", None),
        ("answer -5", -5),
        ("answer x", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_reward_with_strings_and_conversations():
    assert chain_sum_reward(["3+4=7 answer 7", "answer 8", "garbage"], answer=[7, "7", 7]) == [1.0, 0.0, 0.0]
    convs = [[{"role": "assistant", "content": "answer 9"}], [{"role": "assistant", "content": "answer 1"}]]
    assert chain_sum_reward(convs, answer=["9", 2]) == [1.0, 0.0]


@pytest.mark.parametrize("kwargs", [dict(min_terms=1), dict(max_terms=1), dict(tail_exponent=0), dict(max_terms=500)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ChainSumConfig(**kwargs)


def test_grpo_dataset_columns():
    ds = make_grpo_dataset(10, seed=0)
    row = ds[0]
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("add ")
    assert isinstance(row["answer"], int)
    assert isinstance(make_grpo_dataset(3, seed=0, conversational=False)[0]["prompt"], str)
