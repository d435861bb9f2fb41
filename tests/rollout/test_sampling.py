"""Sampling: pure functions against references, and the engine's samples against the exact
processed target distribution (chi-square with fixed seeds)."""

import pytest
import torch
from conftest import cached_model
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.sampling import BatchSamplingTensors, processed_logprobs, sample_from_logprobs

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
]


def hf_processed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference: Hugging Face's warpers in generate's order, then log-softmax."""
    x = logits.clone().float().unsqueeze(0)
    if p.temperature == 0:
        return torch.log_softmax(x, -1)[0]
    x = TemperatureLogitsWarper(p.temperature)(None, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(None, x)
    if p.min_p:
        x = MinPLogitsWarper(p.min_p)(None, x)
    return torch.log_softmax(x, -1)[0]


def test_processed_logprobs_match_hf_warpers_with_mixed_rows():
    torch.manual_seed(0)
    params = SETTINGS + [SamplingParams(temperature=0.0)]
    logits = torch.randn(len(params), 200) * 3
    ours = processed_logprobs(logits, BatchSamplingTensors.from_params(params, logits.device))
    for row, p in enumerate(params):
        ref = hf_processed(logits[row], p)
        kept = torch.isfinite(ref)
        assert torch.equal(kept, torch.isfinite(ours[row])), p
        assert torch.allclose(ours[row][kept], ref[kept], atol=1e-5), p


def test_sampling_never_picks_a_zero_probability_token():
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    logits[:, 25:] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    for u in (torch.rand(64), torch.full((64,), 1 - 1e-12), torch.zeros(64)):
        tokens = sample_from_logprobs(lp, u)
        assert (tokens < 25).all()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; bins with small expected counts are merged."""
    n = counts.sum()
    expected = probs.double() * n
    order = torch.argsort(expected, descending=True)
    obs_bins, exp_bins, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        if expected[i] == 0:
            assert counts[i] == 0, f"token {i} has zero probability but was sampled"
            continue
        acc_o += float(counts[i])
        acc_e += float(expected[i])
        if acc_e >= min_expected:
            obs_bins.append(acc_o)
            exp_bins.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs_bins[-1] += acc_o
        exp_bins[-1] += acc_e
    o, e = torch.tensor(obs_bins, dtype=torch.float64), torch.tensor(exp_bins, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    dof = len(obs_bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def first_token_counts(engine, prompt, params, n, vocab):
    outputs = engine.generate([prompt] * n, params.with_updates(max_new_tokens=1))
    return torch.bincount(torch.tensor([o.completion_ids[0] for o in outputs]), minlength=vocab)


@pytest.fixture(scope="module")
def spread_model():
    return cached_model("qwen2", seed=5, initializer_range=0.05)


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_engine_samples_follow_the_processed_distribution(spread_model, params):
    prompt = [5, 17, 42, 8, 3]
    engine = RolloutEngine(spread_model, RolloutConfig(block_size=4, kv_cache_tokens=8192, seed=123))
    with torch.no_grad():
        logits = spread_model(torch.tensor([prompt])).logits[0, -1]
    probs = hf_processed(logits, params).exp()
    counts = first_token_counts(engine, prompt, params, 4000, logits.shape[-1])
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_chi_square_check_has_power(spread_model):
    """Negative control: T=1.0 samples tested against the T=0.7 distribution must be rejected."""
    prompt = [5, 17, 42, 8, 3]
    engine = RolloutEngine(spread_model, RolloutConfig(block_size=4, kv_cache_tokens=8192, seed=7))
    with torch.no_grad():
        logits = spread_model(torch.tensor([prompt])).logits[0, -1]
    counts = first_token_counts(engine, prompt, SamplingParams(temperature=1.0), 4000, logits.shape[-1])
    wrong = hf_processed(logits, SamplingParams(temperature=0.7)).exp()
    assert chi_square_pvalue(counts, wrong) < 1e-6


@pytest.mark.parametrize("params", SETTINGS[1:], ids=["topk", "topp", "minp", "all"])
def test_returned_logprobs_equal_one_full_forward(spread_model, params):
    engine = RolloutEngine(spread_model, RolloutConfig(block_size=4, kv_cache_tokens=8192, seed=3))
    prompts = [[5, 17, 42], [9, 9, 30, 31, 2, 7], [60]]
    outputs = engine.generate(prompts, params.with_updates(max_new_tokens=12))
    for o in outputs:
        ids = torch.tensor([o.prompt_ids + o.completion_ids])
        with torch.no_grad():
            logits = spread_model(ids).logits[0]
        start = len(o.prompt_ids) - 1
        for j, (tok, lp) in enumerate(zip(o.completion_ids, o.logprobs)):
            ref = hf_processed(logits[start + j], params)[tok]
            assert torch.isfinite(ref)
            assert abs(float(ref) - lp) < 1e-4


def test_seeded_requests_do_not_depend_on_their_batch(spread_model):
    seeded = SamplingParams(temperature=1.0, seed=7, max_new_tokens=10)
    other = SamplingParams(temperature=1.0, max_new_tokens=10)
    prompt = [5, 17, 42]
    alone = RolloutEngine(spread_model, RolloutConfig(block_size=4, seed=1)).generate([prompt], seeded)[0]
    batch = RolloutEngine(spread_model, RolloutConfig(block_size=4, seed=2)).generate(
        [[9, 9, 30], prompt, [60, 61]], [other, seeded, other]
    )[1]
    assert alone.completion_ids == batch.completion_ids
    assert alone.logprobs == pytest.approx(batch.logprobs, abs=1e-5)
