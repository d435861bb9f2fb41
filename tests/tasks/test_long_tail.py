"""The long-tailed workload: its prompts, the length distribution its reference responses have, and
the short SFT runs that extend a policy and its drafter LM to it."""

import pytest
import torch

from tailspec.tasks.chain_sum import ChainSumProblem
from tailspec.tasks.long_tail import (
    LONG_TAIL_TASK,
    MAX_CONTEXT,
    ExtendRecipe,
    distill_drafter,
    extend_policy,
    length_fidelity,
    length_summary,
    long_tail_problems,
)
from tailspec.tasks.sft import load_tiny


def test_every_step_holds_exactly_one_long_problem():
    questions = long_tail_problems(steps=20, per_step=8, seed=3)
    assert len(questions) == 160 and questions == long_tail_problems(steps=20, per_step=8, seed=3)
    for step in range(20):
        terms = [len(ChainSumProblem.from_question(q).terms) for q in questions[8 * step : 8 * step + 8]]
        assert sum(n >= LONG_TAIL_TASK.long_min_terms for n in terms) == 1
        assert all(LONG_TAIL_TASK.min_terms <= n <= LONG_TAIL_TASK.max_terms for n in terms)
    with pytest.raises(ValueError, match="per_step must be an int >= 2"):
        long_tail_problems(steps=1, per_step=1, seed=0)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        long_tail_problems(steps=0, per_step=8, seed=0)


def test_the_reference_responses_have_an_rl_like_tail():
    """Most a few hundred tokens, a tail to about 2k, p99 at least 8x the median (the issue's
    shape), measured on the responses the task's problems call for (a character a token)."""
    questions = long_tail_problems(steps=64, per_step=8, seed=0)
    lengths = [len(ChainSumProblem.from_question(q).solution) + 1 for q in questions]  # + EOS
    summary = length_summary(lengths)
    assert 150 <= summary["median"] <= 300
    assert summary["p99_over_median"] >= 8 and 1800 <= summary["max"] <= 2048


def test_length_summary_takes_nearest_rank_percentiles():
    summary = length_summary(list(range(1, 101)))
    assert summary == {"completions": 100, "median": 50.5, "p90": 90, "p99": 99, "max": 100, "p99_over_median": 1.96}
    assert length_summary([7])["p99"] == 7
    with pytest.raises(ValueError, match="lengths is empty"):
        length_summary([])


def test_the_recipe_checks_its_fields_and_cuts_the_task_for_a_rehearsal():
    assert ExtendRecipe().task() is LONG_TAIL_TASK
    short = ExtendRecipe(max_terms=16).task()
    assert (short.max_terms, short.long_min_terms, short.min_terms) == (16, 16, LONG_TAIL_TASK.min_terms)
    assert ExtendRecipe(max_terms=16).sft(3, 1e-3).max_len >= 12 * 16
    with pytest.raises(ValueError, match="max_terms must be an int in"):
        ExtendRecipe(max_terms=400)
    with pytest.raises(ValueError, match="policy_steps must be an int >= 1"):
        ExtendRecipe(policy_steps=0)


def test_extending_a_policy_trains_it_and_admits_long_contexts():
    policy, tokenizer = load_tiny("policy")
    drafter, _ = load_tiny("drafter")
    before = [p.detach().clone() for p in policy.parameters()]
    recipe = ExtendRecipe(policy_steps=2, drafter_steps=2, batch_size=2, max_terms=16)
    metrics = extend_policy(policy, tokenizer, recipe)
    assert metrics["steps"] == 2 and torch.isfinite(torch.tensor(metrics["final_loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    assert policy.config.max_position_embeddings == MAX_CONTEXT
    distilled = distill_drafter(drafter, policy, tokenizer, recipe)
    assert distilled["steps"] == 2 and drafter.config.max_position_embeddings == MAX_CONTEXT


def test_length_fidelity_says_how_a_policy_follows_the_chain():
    policy, tokenizer = load_tiny("policy")
    fidelity = length_fidelity(policy, tokenizer, [3, 4])
    assert [r["terms"] for r in fidelity["problems"]] == [3, 4]
    # the tiny policy learned sums of up to 40 terms: it ends these, about as long as their references
    assert fidelity["ended"] == 1.0 and 0.5 <= fidelity["length_ratio_median"] <= 1.5
    assert 0 < fidelity["length_ratio_median"] <= 2 and 0 <= fidelity["right"] <= fidelity["ended"] <= 1
