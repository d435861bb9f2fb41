"""The length-aware draft budget: only the sequences expected to run longest draft, and it never
changes a token (greedy output equals plain decoding)."""

import math

import pytest
from rollout_helpers import EOS, cached_model, random_prompts

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.request import Sequence
from tailspec.rollout.spec.length_budget import drafting_mask, expected_remaining


def _seq(expected, generated=0, max_new=100):
    seq = Sequence(0, [1, 2], SamplingParams(max_new_tokens=max_new), frozenset())
    seq.expected_length = expected
    seq.output_ids = [3] * generated
    return seq


def test_expected_remaining():
    assert expected_remaining(_seq(None)) == math.inf
    assert expected_remaining(_seq(50, generated=10)) == 40
    assert expected_remaining(_seq(50, generated=80)) == 20  # outlived its prediction; capped by max_new_tokens
    assert expected_remaining(_seq(50, generated=30, max_new=200)) == 30  # as many more as it has generated
    assert expected_remaining(_seq(5, generated=0)) == 5


def test_only_the_longest_draft():
    seqs = [_seq(200, max_new=1000), _seq(20, max_new=1000), _seq(150, max_new=1000), _seq(90, max_new=1000)]
    assert drafting_mask(seqs, 0.5) == [True, False, True, False]
    assert drafting_mask(seqs, 0.0) == [True] * 4
    assert drafting_mask([_seq(None), _seq(300, max_new=1000)], 0.5) == [True, False]  # unknown counts as the longest


@pytest.mark.parametrize("strategy", ["chain:3", "suffix"])
def test_budget_changes_no_token(strategy):
    model = cached_model("qwen3")
    drafter = cached_model("qwen3", seed=5) if strategy.startswith("chain") else None
    prompts = random_prompts(6, seed=17)
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    want = RolloutEngine(model, RolloutConfig(kv_cache_tokens=4096), eos_token_ids=[EOS]).generate(prompts, params)
    engine = RolloutEngine(
        model,
        RolloutConfig(kv_cache_tokens=4096, strategy=strategy, length_budget=0.6),
        eos_token_ids=[EOS],
        drafter=drafter,
    )
    ids = [engine.add_request(p, params, expected_length=float(4 + 6 * i)) for i, p in enumerate(prompts)]
    got = {}
    while engine.has_unfinished():
        for r in engine.step():
            got[r] = engine.pop_output(r)
    assert [got[i].completion_ids for i in ids] == [o.completion_ids for o in want]
    drafted = [got[i].num_drafted for i in ids]
    assert drafted[-1] > 0 and min(drafted) < drafted[-1]  # the longest-expected drafted most


def test_length_budget_is_validated():
    with pytest.raises(ValueError, match="length_budget"):
        RolloutConfig(length_budget=1.5)
