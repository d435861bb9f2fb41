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
    assert ChainSumProblem((9, 9)).solution == "9+9=18 answer 18"


def test_the_lines_layout_is_the_same_sums_in_another_format():
    p = ChainSumProblem((3, 5, 2, 7))
    assert p.solution_in("chain") == p.solution
    assert p.solution_in("lines") == "3 + 5 = 8\n8 + 2 = 10\n10 + 7 = 17\nanswer: 17"
    assert extract_answer(p.solution_in("lines")) == 17
    assert chain_sum_reward([p.solution_in("lines")], [17]) == [1.0]
    with pytest.raises(ValueError, match="layout"):
        p.solution_in("json")


def test_problems_from_questions():
    for p in sample_problems(50, seed=4):
        assert ChainSumProblem.from_question(p.question) == p
    assert ChainSumProblem.from_question("  add 1   2 ").terms == (1, 2)
    for bad in ["add", "sum 1 2", "add 1 12", "add 1 -2", "add 1 x", "", None, "add " + "1 " * 201]:
        with pytest.raises(ValueError, match="chain-sum question"):
            ChainSumProblem.from_question(bad)


def test_solutions_are_running_sums():
    for p in sample_problems(300, seed=3):
        steps = p.solution.split(" ")
        assert steps[-2:] == ["answer", str(sum(p.terms))]
        total = p.terms[0]
        for step, term in zip(steps[:-2], p.terms[1:]):
            assert step == f"{total}+{term}={total + term}"
            total += term
        assert len(steps) - 2 == len(p.terms) - 1


def test_sampling_is_deterministic_and_in_range():
    cfg = ChainSumConfig(min_terms=2, max_terms=12, long_fraction=0.0)
    a, b = sample_problems(300, seed=5, cfg=cfg), sample_problems(300, seed=5, cfg=cfg)
    assert a == b
    assert a != sample_problems(300, seed=6, cfg=cfg)
    assert all(2 <= len(p.terms) <= 12 and all(0 <= t <= 9 for t in p.terms) for p in a)
    assert len(sample_problem(random.Random(0), cfg, num_terms=7).terms) == 7


def test_default_distribution():
    cfg = ChainSumConfig()
    probs = cfg.probabilities()
    assert sum(probs.values()) == pytest.approx(1.0)
    assert set(probs) == set(range(2, 41))
    assert all(probs[n] > probs[n + 1] for n in range(2, 14))  # power-law body
    assert 0.05 <= sum(p for n, p in probs.items() if n >= 15) <= 0.1
    assert sum(p for n, p in probs.items() if n <= 5) >= 0.6
    counts = [len(p.terms) for p in sample_problems(4000, seed=2)]
    assert sum(n >= 15 for n in counts) / len(counts) == pytest.approx(0.1, abs=0.02)
    assert max(counts) <= 40 and min(counts) >= 2


def test_solution_lengths_are_heavy_tailed():
    lengths = sorted(len(p.solution) for p in sample_problems(2000, seed=1))
    median = statistics.median(lengths)
    assert lengths[int(0.95 * len(lengths))] >= 8 * median
    assert lengths[-1] >= 12 * median
    assert median <= 30


def test_plain_power_law_without_long_component():
    cfg = ChainSumConfig(long_fraction=0.0, tail_exponent=2.0)
    probs = cfg.probabilities()
    assert set(probs) == set(range(2, 41))
    assert probs[4] / probs[2] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1+2=3 answer 3", 3),
        ("answer 4 then answer 12", 12),
        ("3+4=7 answer 7<|eos|>", 7),
        ("answer 7 answer", 7),
        ("no result", None),
        ("", None),
        ("answer -5", -5),
        ("answer x", None),
        ("answer12", None),
        ("reanswer 5", None),
        ("answer " + "9" * 5000, None),  # over Python's int-from-str limit: no crash
        (None, None),
        (17, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_reward_with_strings_and_conversations():
    assert chain_sum_reward(["3+4=7 answer 7", "answer 8", "garbage", ""], answer=[7, "7", 7, 0]) == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    convs = [
        [{"role": "assistant", "content": "answer 9"}],
        [{"role": "user", "content": "answer 1"}, {"role": "assistant", "content": "answer 2"}],
        [{"role": "assistant", "content": "answer 3"}],
    ]
    assert chain_sum_reward(convs, answer=["9", 1, " 3 "], prompts=["a", "b", "c"]) == [1.0, 0.0, 1.0]
    assert chain_sum_reward([[]], answer=[1]) == [0.0]
    assert chain_sum_reward(["answer 1"], answer=["not a number"]) == [0.0]
    with pytest.raises(ValueError, match="answers"):
        chain_sum_reward(["answer 1", "answer 2"], answer=[1])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(min_terms=1), "min_terms"),
        (dict(min_terms=2.5), "min_terms"),
        (dict(max_terms=1), "max_terms"),
        (dict(max_terms=500), "max_terms"),
        (dict(tail_exponent=0), "tail_exponent"),
        (dict(tail_exponent=-1.0), "tail_exponent"),
        (dict(long_fraction=1.0), "long_fraction"),
        (dict(long_fraction=-0.1), "long_fraction"),
        (dict(long_min_terms=41), "long_min_terms"),
        (dict(max_terms=12), "long_min_terms"),
        (dict(long_min_terms=2), "long_min_terms"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ChainSumConfig(**kwargs)


def test_grpo_dataset_columns():
    ds = make_grpo_dataset(10, seed=0)
    assert set(ds.column_names) >= {"prompt", "answer"}
    problems = sample_problems(10, seed=0)
    for row, p in zip(ds, problems):
        assert row["prompt"] == [{"role": "user", "content": p.question}]
        assert row["answer"] == p.answer and isinstance(row["answer"], int)
    raw = make_grpo_dataset(3, seed=0, conversational=False)
    assert raw[0]["prompt"] == f"<|user|>{problems[0].question}<|assistant|>"
    assert raw[0]["answer"] == problems[0].answer
