import math

import pytest
import torch
from fakes import EOS, ScriptedClient, chunk_writer, iid_scorer

from tailspec.atts import (
    ATTSConfig,
    ATTSRunner,
    Author,
    ConformalCalibration,
    NeverTakeover,
    run_synchronous,
    sample_only,
)
from tailspec.rollout import RolloutConfig, RolloutEngine
from tailspec.testing import tiny_random_model


def _beta_binomial_interval(m: int, a: float, b: float, level: float) -> tuple[int, int]:
    def log_pmf(x):
        return (
            math.lgamma(m + 1)
            - math.lgamma(x + 1)
            - math.lgamma(m - x + 1)
            + math.lgamma(x + a)
            + math.lgamma(m - x + b)
            - math.lgamma(m + a + b)
            + math.lgamma(a + b)
            - math.lgamma(a)
            - math.lgamma(b)
        )

    pmf = [math.exp(log_pmf(x)) for x in range(m + 1)]
    tail, acc, lo = (1 - level) / 2, 0.0, 0
    while acc + pmf[lo] <= tail:
        acc, lo = acc + pmf[lo], lo + 1
    acc, hi = 0.0, m
    while acc + pmf[hi] <= tail:
        acc, hi = acc + pmf[hi], hi - 1
    return lo, hi


@pytest.mark.parametrize("alpha", [0.1, 0.25, 0.5])
def test_realized_takeover_rate_matches_alpha_with_exchangeable_scores(alpha):
    """Calibrated through the runner's own path, then run: with iid scores the number of takeovers
    among m decisions is beta-binomial (the threshold's coverage is Beta(k, n + 1 - k))."""
    config = ATTSConfig(alpha=alpha, num_samples=4, chunk_tokens=2, max_new_tokens=64, max_turns=64)
    writer = chunk_writer(7, chunks_per_sample=20, polls=lambda p: 1)
    draft = ScriptedClient("draft", writer)
    target = ScriptedClient("target", iid_scorer(seed=int(alpha * 100), draft_reply=chunk_writer(8, 20, lambda p: 1)))
    runner = ATTSRunner(draft, target, config)
    calibration = runner.calibrate([[2, 3 + q] for q in range(10)])
    assert calibration.n == 10 * 4 * 20  # every turn of every sample, not only the first
    result = runner.run([[2, 40 + q] for q in range(10)], calibration)
    m = result.num_scored
    assert m == 800 and len(result.decisions) == m
    n = calibration.n
    k = math.ceil((n + 1) * (1 - alpha))
    lo, hi = _beta_binomial_interval(m, n + 1 - k, k, level=0.999)
    assert lo <= result.num_takeovers <= hi, (result.num_takeovers, lo, hi)
    assert result.takeover_rate == pytest.approx(alpha, abs=0.06)


def test_a_slow_sample_does_not_delay_the_others():
    """Question 0's draft chunks take 40 polls, the others' 1: in the asynchronous runner every
    other sample finishes before question 0's first chunk is even drafted; the synchronous
    baseline (same scripted engines) makes them wait at every turn."""
    config = ATTSConfig(alpha=0.3, num_samples=2, chunk_tokens=2, max_new_tokens=32, max_turns=32)

    def polls(prompt):
        return 40 if prompt[1] == 50 else 1

    def clients():
        draft = ScriptedClient("draft", chunk_writer(7, 4, polls))
        target = ScriptedClient("target", iid_scorer(0, chunk_writer(8, 4, lambda p: 1)))
        return draft, target

    prompts = [[2, 50], [2, 51], [2, 52], [2, 53]]
    calibration = ConformalCalibration.from_scores([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
    result = ATTSRunner(*clients(), config).run(prompts, calibration)
    slow = {s.sample_id for s in result.samples if s.question_index == 0}
    first_slow_draft = min(e.tick for e in result.events if e.sample_id in slow and e.kind == "drafted")
    finished = {e.sample_id: e.tick for e in result.events if e.kind == "finished"}
    assert len(finished) == 8
    assert all(tick < first_slow_draft for sid, tick in finished.items() if sid not in slow)
    assert all(s.finish_reason == "stop" and s.completion_ids[-1] == EOS for s in result.samples)

    sync = run_synchronous(*clients(), prompts, config)
    sync_slow_draft = min(e.tick for e in sync.events if e.sample_id in slow and e.kind == "drafted")
    sync_finished = {e.sample_id: e.tick for e in sync.events if e.kind == "finished"}
    assert all(tick > sync_slow_draft for sid, tick in sync_finished.items() if sid not in slow)


def test_synchronous_baseline_takes_over_its_budget_every_turn():
    config = ATTSConfig(alpha=0.25, num_samples=4, chunk_tokens=2, max_new_tokens=16, max_turns=16)
    draft = ScriptedClient("draft", chunk_writer(7, 3, lambda p: 1))
    target = ScriptedClient("target", iid_scorer(3, chunk_writer(8, 3, lambda p: 1)))
    result = run_synchronous(draft, target, [[2, 5], [2, 6]], config)
    per_turn: dict[int, int] = {}
    for s in result.samples:
        for t in s.turns:
            per_turn[t.index] = per_turn.get(t.index, 0) + (t.author is Author.TARGET)
    assert per_turn == {0: 2, 1: 2, 2: 2}  # round(0.25 * 8) of the 8 samples, each of 3 turns


# -- real engines ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    target = tiny_random_model("llama", seed=3, initializer_range=0.2)
    draft = tiny_random_model("qwen2", seed=4, initializer_range=0.2)
    config = RolloutConfig(block_size=8, kv_cache_tokens=16384)
    return RolloutEngine(draft, config), RolloutEngine(target, config), target


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 96, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def test_scored_chunks_are_exactly_the_drafted_tokens(engines):
    """Every scored span is the drafted chunk, at the offset where the chunk starts in the exact
    input ids, and its score equals the mean NLL from a plain forward of the target."""
    draft, target, target_model = engines
    config = ATTSConfig(alpha=0.3, num_samples=3, chunk_tokens=5, delimiter_ids=(7, 11), max_new_tokens=24, seed=5)
    runner = ATTSRunner(draft, target, config)
    calibration = runner.calibrate(_prompts(4, seed=1))
    result = runner.run(_prompts(3, seed=2), calibration)
    prompts = _prompts(3, seed=2)
    assert result.num_takeovers > 0 and result.num_scored > result.num_takeovers
    for sample in result.samples:
        history: list[int] = []
        prompt = prompts[sample.question_index]
        for turn in sample.turns:
            assert turn.scored_ids == turn.draft_ids
            assert turn.offset == len(prompt) + len(history)
            assert 1 <= len(turn.draft_ids) <= 5
            ids = prompt + history + list(turn.draft_ids)
            with torch.no_grad():
                logits = target_model(torch.tensor([ids])).logits[0].float()
            logprobs = torch.log_softmax(logits[turn.offset - 1 : -1], dim=-1)
            nll = -logprobs.gather(-1, torch.tensor(turn.draft_ids).unsqueeze(-1)).mean().item()
            assert turn.score == pytest.approx(nll, abs=1e-4)
            assert (turn.author is Author.TARGET) == (turn.score > turn.threshold)
            if turn.author is Author.DRAFT:
                assert turn.token_ids == turn.draft_ids
            ended = turn.token_ids[-1] in (7, 11, 1) or len(turn.token_ids) == 5
            assert ended or len(history) + len(turn.token_ids) == 24
            history.extend(turn.token_ids)
        assert history == sample.completion_ids


def test_runs_are_reproducible(engines):
    draft, target, _ = engines
    config = ATTSConfig(alpha=0.3, num_samples=2, chunk_tokens=4, max_new_tokens=16, seed=9)
    runner = ATTSRunner(draft, target, config)
    calibration = runner.calibrate(_prompts(2, seed=1))
    a = runner.run(_prompts(3, seed=3), calibration)
    b = runner.run(_prompts(3, seed=3), calibration)
    assert [s.completion_ids for s in a.samples] == [s.completion_ids for s in b.samples]


def test_never_takeover_equals_chunked_draft_sampling(engines):
    """With no takeover the completion is the draft's alone, written chunk by chunk."""
    draft, target, _ = engines
    config = ATTSConfig(alpha=0.5, num_samples=1, chunk_tokens=3, max_new_tokens=12, temperature=0.0)
    result = ATTSRunner(draft, target, config).run(_prompts(3, seed=4), policy=NeverTakeover())
    whole, _ = sample_only(draft, _prompts(3, seed=4), config, role="draft")
    assert [s.completion_ids for s in result.samples] == whole


def test_bad_input_is_refused_before_anything_runs(engines):
    draft, target, _ = engines
    runner = ATTSRunner(draft, target, ATTSConfig(max_new_tokens=16))
    calibration = ConformalCalibration.from_scores([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"prompt 1 \(draft\).*vocabulary"):
        runner.run([[3, 4], [3, 500]], calibration)
    with pytest.raises(ValueError, match="prompts is empty"):
        runner.run([], calibration)
    with pytest.raises(ValueError, match="calibration is required"):
        runner.run([[3, 4]])
    with pytest.raises(ValueError, match="max_model_len"):
        ATTSRunner(draft, target, ATTSConfig(max_new_tokens=600)).run([[3, 4]], calibration)
    assert not draft.has_unfinished() and not target.has_unfinished()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("alpha", 0.0, r"alpha must be in \(0, 1\)"),
        ("alpha", 1.0, r"alpha must be in \(0, 1\)"),
        ("num_samples", 0, "num_samples"),
        ("chunk_tokens", 0, "chunk_tokens"),
        ("delimiter_ids", (-1,), "delimiter_ids"),
        ("mode", "rank", "mode"),
        ("max_turns", 0, "max_turns"),
    ],
)
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        ATTSConfig(**{field: value})


def test_tokenizer_mismatch_is_refused(engines):
    from tailspec.tasks.tokenizer import build_tokenizer

    draft, target, _ = engines
    same = build_tokenizer()
    ATTSRunner(draft, target, draft_tokenizer=same, target_tokenizer=build_tokenizer())
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="draft and target tokenizers differ.*only in draft \\['<extra>'\\]"):
        ATTSRunner(draft, target, draft_tokenizer=other, target_tokenizer=same)
