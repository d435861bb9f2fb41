"""Sampling: pure functions against references, and the engine's samples against the exact
processed target distribution (chi-square with fixed seeds)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_helpers import cached_model, chi_square_pvalue
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.model.kv_cache import blocks_for
from tailspec.rollout.sampling import (
    BatchSamplingTensors,
    choose_tokens,
    draw_uniforms,
    processed_logprobs,
    sample_from_logprobs,
)

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
]
MIXED = SETTINGS + [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5),  # filters are ignored when greedy
    SamplingParams(temperature=0.5, top_k=1),
    SamplingParams(temperature=2.0, top_p=0.3, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=500),  # k larger than the vocabulary = off
]


def _tensors(params):
    return BatchSamplingTensors.from_params(params, torch.device("cpu"))


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


def plain_processed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference written out per row in float64: temperature -> top-k -> top-p -> min-p.

    Each filter sees the distribution left by the previous one. Ties: top-k keeps every token
    tied with the k-th largest; top-p walks tokens from the most likely down, keeping each until
    the kept mass reaches top_p (how tied tokens are ordered there is arbitrary).
    """
    x = logits.double()
    if p.temperature == 0:
        return torch.log_softmax(x, -1).float()
    x = x / p.temperature
    vocab = x.shape[-1]
    keep = [True] * vocab

    def probs():
        return torch.softmax(x.masked_fill(~torch.tensor(keep), -math.inf), -1).tolist()

    if p.top_k > 0:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, vocab) - 1]
        keep = [k and v >= kth for k, v in zip(keep, x.tolist())]
    if p.top_p < 1:
        pr = probs()
        mass, kept = 0.0, set()
        for i in sorted(range(vocab), key=lambda i: -pr[i]):
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += pr[i]
        keep = [k and i in kept for i, k in enumerate(keep)]
    if p.min_p > 0:
        pr = probs()
        top = max(pr)
        keep = [k and q >= p.min_p * top for k, q in zip(keep, pr)]
    return torch.log_softmax(x.masked_fill(~torch.tensor(keep), -math.inf), -1).float()


def _assert_same_distribution(ours: torch.Tensor, ref: torch.Tensor, what, atol=1e-5):
    kept = torch.isfinite(ref)
    assert torch.equal(kept, torch.isfinite(ours)), what
    assert torch.allclose(ours[kept], ref[kept], atol=atol), what


@pytest.mark.parametrize("reference", [plain_processed, hf_processed], ids=["plain", "hf"])
def test_processed_logprobs_match_references_with_mixed_rows(reference):
    """Continuous random logits (no ties): every row processed with its own parameters."""
    g = torch.Generator().manual_seed(0)
    for trial in range(6):
        logits = torch.randn(len(MIXED), 200, generator=g) * (1 + trial)
        ours = processed_logprobs(logits, _tensors(MIXED))
        assert ours.dtype == torch.float32 and ours.shape == logits.shape
        for row, p in enumerate(MIXED):
            _assert_same_distribution(ours[row], reference(logits[row], p), (trial, p))


def test_processed_logprobs_random_params_match_hf():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        n = int(torch.randint(1, 9, (1,), generator=g))
        params = []
        for _ in range(n):
            r = torch.rand(4, generator=g).tolist()
            params.append(
                SamplingParams(
                    temperature=0.0 if r[0] < 0.15 else 0.2 + 2 * r[0],
                    top_k=int(torch.randint(0, 60, (1,), generator=g)) if r[1] < 0.5 else 0,
                    top_p=0.05 + 0.95 * r[2] if r[2] < 0.6 else 1.0,
                    min_p=r[3] * 0.5 if r[3] < 0.5 else 0.0,
                )
            )
        logits = torch.randn(n, 64, generator=g) * 4
        ours = processed_logprobs(logits, _tensors(params))
        for row, p in enumerate(params):
            _assert_same_distribution(ours[row], hf_processed(logits[row], p), p)


def test_processed_logprobs_with_tied_logits():
    """Integer logits tie a lot. Top-k keeps every token tied with the k-th (as HF does), min-p
    is a threshold (ties irrelevant); for top-p only the set's defining property is checked,
    since which of several tied tokens at the boundary is kept depends on sort order."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-3, 4, (4, 40), generator=g).float()
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.8, min_p=0.3),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0),
    ]
    ours = processed_logprobs(logits, _tensors(params))
    for row, p in enumerate(params):
        _assert_same_distribution(ours[row], plain_processed(logits[row], p), p)
        _assert_same_distribution(ours[row], hf_processed(logits[row], p), p)
    assert int(torch.isfinite(ours[2]).sum()) == int((logits[2] == logits[2].max()).sum())

    top_p = 0.6
    lp = processed_logprobs(logits, _tensors([SamplingParams(temperature=1.0, top_p=top_p)] * 4))
    full = torch.softmax(logits, -1)
    for row in range(4):
        kept = torch.isfinite(lp[row])
        assert full[row][kept].min() >= full[row][~kept].max()  # kept = most likely tokens
        mass = full[row][kept].sum()
        assert mass >= top_p - 1e-6
        assert mass - full[row][kept].min() < top_p + 1e-6  # and no more than needed


def test_processed_distribution_properties():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(MIXED), 80, generator=g) * 3
    lp = processed_logprobs(logits, _tensors(MIXED))
    assert torch.allclose(lp.exp().sum(-1), torch.ones(len(MIXED)), atol=1e-5)
    assert torch.equal(lp.argmax(-1), logits.argmax(-1))  # filtering never drops the mode
    for row, p in enumerate(MIXED):
        if p.greedy:  # greedy rows report the raw softmax, whatever their filters say
            assert torch.allclose(lp[row], torch.log_softmax(logits[row], -1), atol=1e-6)
        if p.top_k == 1 and not p.greedy:
            assert int(torch.isfinite(lp[row]).sum()) == 1


def test_sample_from_logprobs_is_inverse_cdf():
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25]])
    lp = probs.log()
    for u, token in [(0.0, 0), (0.1, 0), (0.2499, 0), (0.2501, 2), (0.7499, 2), (0.7501, 3), (1 - 1e-15, 3)]:
        assert int(sample_from_logprobs(lp, torch.tensor([u], dtype=torch.float64))) == token, u
    # a trailing zero-probability token is never reached, even with u as close to 1 as it gets
    lp = torch.tensor([[0.5, 0.5, 0.0]]).log()
    assert int(sample_from_logprobs(lp, torch.tensor([math.nextafter(1.0, 0.0)], dtype=torch.float64))) == 1


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    values=st.lists(st.floats(-30, 30) | st.just(-math.inf), min_size=1, max_size=40),
    u=st.floats(0.0, 1.0, exclude_max=True) | st.sampled_from([0.0, math.nextafter(1.0, 0.0), 1 - 1e-9]),
    scale=st.sampled_from([0.01, 1.0, 50.0]),
)
def test_sampling_never_picks_a_zero_probability_token(values, u, scale):
    logits = torch.tensor(values, dtype=torch.float32) * scale
    if not torch.isfinite(logits).any():
        logits[len(values) // 2] = 0.0
    lp = torch.log_softmax(logits, -1).unsqueeze(0)
    token = int(sample_from_logprobs(lp, torch.tensor([u], dtype=torch.float64)))
    assert 0 <= token < len(values)
    assert math.isfinite(float(lp[0, token]))


def test_sampling_never_picks_a_zero_probability_token_in_bulk():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(256, 50, generator=g) * 5
    logits[torch.rand(256, 50, generator=g) < 0.7] = -math.inf
    logits[:, 7] = 0.0  # every row keeps at least one token
    lp = torch.log_softmax(logits, -1)
    near_one = torch.full((256,), math.nextafter(1.0, 0.0), dtype=torch.float64)
    for u in [torch.rand(256, generator=g, dtype=torch.float64) for _ in range(200)] + [near_one]:
        tokens = sample_from_logprobs(lp, u)
        assert torch.isfinite(lp.gather(-1, tokens.unsqueeze(-1))).all()


def test_choose_tokens_and_per_request_uniforms():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    st_ = _tensors(params)
    lp = processed_logprobs(logits, st_)
    for u in (torch.zeros(4, dtype=torch.float64), torch.full((4,), 0.999, dtype=torch.float64)):
        chosen = choose_tokens(lp, st_, u)
        assert chosen[0] == logits[0].argmax() and chosen[2] == logits[2].argmax()
        assert torch.equal(chosen[1::2], sample_from_logprobs(lp[1::2], u[1::2]))
    # a seeded row's uniform comes from its own generator, whatever the other rows are
    fallback = torch.Generator().manual_seed(0)
    first = draw_uniforms([None, torch.Generator().manual_seed(7), None], fallback)
    second = draw_uniforms([torch.Generator().manual_seed(7)], torch.Generator().manual_seed(1))
    assert first[1] == second[0] == torch.rand(1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert ((first >= 0) & (first < 1)).all()


# -- statistical checks of the engine's samples -------------------------------------------


def test_chi_square_pvalue_matches_known_quantiles():
    def sf(x, dof):
        return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2)))

    assert sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)
    assert sf(10.0, 10) == pytest.approx(0.4404932851, abs=1e-8)
    uniform = torch.full((4,), 0.25)
    assert chi_square_pvalue(torch.tensor([250, 250, 250, 250]), uniform) == pytest.approx(1.0)
    assert chi_square_pvalue(torch.tensor([400, 200, 200, 200]), uniform) < 1e-10


def first_token_counts(engine, prompt, params, n, vocab):
    """First generated token of ``n`` copies of one prompt (a forked group: one prefill)."""
    outputs = engine.generate([prompt] * n, params.with_updates(max_new_tokens=1))
    assert engine.stats.forked_prefills > 0
    return torch.bincount(torch.tensor([o.completion_ids[0] for o in outputs]), minlength=vocab)


@pytest.fixture(scope="module")
def spread_model():
    """Small initializer range: a spread-out next-token distribution, so the tests have power."""
    return cached_model("qwen2", seed=5, initializer_range=0.05)


PROMPT = [5, 17, 42, 8, 3]


def _first_token_logits(model):
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_engine_samples_follow_the_processed_distribution(spread_model, params):
    engine = RolloutEngine(spread_model, RolloutConfig(block_size=4, kv_cache_tokens=8192, seed=123))
    logits = _first_token_logits(spread_model)
    probs = hf_processed(logits, params).exp()
    assert int((probs > 0).sum()) >= 8  # a spread-out target, not a near-deterministic one
    counts = first_token_counts(engine, PROMPT, params, 4000, logits.shape[-1])
    assert int(counts[probs == 0].sum()) == 0
    assert chi_square_pvalue(counts, probs) > 1e-3


@pytest.mark.parametrize(
    "drawn, claimed",
    [
        (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)),
        (SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, top_p=0.9)),
    ],
    ids=["temperature", "top_p"],
)
def test_chi_square_check_has_power(spread_model, drawn, claimed):
    """Negative control: samples tested against a slightly wrong distribution must be rejected
    (for top_p the claimed support is larger, so the extra tokens are never drawn)."""
    engine = RolloutEngine(spread_model, RolloutConfig(block_size=4, kv_cache_tokens=8192, seed=7))
    logits = _first_token_logits(spread_model)
    counts = first_token_counts(engine, PROMPT, drawn, 4000, logits.shape[-1])
    assert chi_square_pvalue(counts, hf_processed(logits, drawn).exp()) > 1e-3
    assert chi_square_pvalue(counts, hf_processed(logits, claimed).exp()) < 1e-6


LOGPROB_CASES = {
    "topk": SETTINGS[1],
    "topp": SETTINGS[2],
    "minp": SETTINGS[3],
    "all": SETTINGS[4],
    "mixed": [SETTINGS[1], SETTINGS[2], SETTINGS[3], SETTINGS[4], SamplingParams(temperature=0.0)],
}


@pytest.mark.parametrize("case", LOGPROB_CASES)
def test_returned_logprobs_equal_one_full_forward(spread_model, case):
    """Each returned logprob = processed log-probability from ONE plain forward of prompt+completion."""
    prompts = [[5, 17, 42], [9, 9, 30, 31, 2, 7], [60], [5, 17, 42], [11, 12, 13, 14]]
    params = LOGPROB_CASES[case]
    per_row = params if isinstance(params, list) else [params] * len(prompts)
    per_row = [p.with_updates(max_new_tokens=12) for p in per_row]
    engine = RolloutEngine(spread_model, RolloutConfig(block_size=4, kv_cache_tokens=8192, seed=3))
    outputs = engine.generate(prompts, per_row)
    assert engine.stats.forked_prefills == 1  # the repeated prompt is forked
    for o, p in zip(outputs, per_row):
        with torch.no_grad():
            logits = spread_model(torch.tensor([o.prompt_ids + o.completion_ids])).logits[0]
        start = len(o.prompt_ids) - 1
        for j, (tok, lp) in enumerate(zip(o.completion_ids, o.logprobs)):
            ref = hf_processed(logits[start + j], p)[tok]
            assert torch.isfinite(ref), (case, j)
            assert abs(float(ref) - lp) < 1e-4, (case, j)


SEEDED = SamplingParams(temperature=1.0, seed=7, max_new_tokens=10)
OTHER = SamplingParams(temperature=1.0, max_new_tokens=10)


def test_seeded_requests_do_not_depend_on_their_batch(spread_model):
    prompt = [5, 17, 42]
    alone = RolloutEngine(spread_model, RolloutConfig(block_size=4, seed=1)).generate([prompt], SEEDED)[0]
    again = RolloutEngine(spread_model, RolloutConfig(block_size=4, seed=99)).generate([prompt], SEEDED)[0]
    assert again.completion_ids == alone.completion_ids
    batch = RolloutEngine(spread_model, RolloutConfig(block_size=4, seed=2)).generate(
        [[9, 9, 30], prompt, [60, 61], prompt, prompt],  # in a forked group with other seeds too
        [OTHER, SEEDED, OTHER, SEEDED.with_updates(seed=8), OTHER],
    )
    assert batch[1].completion_ids == alone.completion_ids
    assert batch[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert batch[3].completion_ids != alone.completion_ids  # another seed, another sample


def test_seeded_requests_survive_preemption(spread_model):
    """Recompute after preemption continues the request's own random stream: same tokens."""
    prompts = [[5, 17, 42], [9, 9, 30, 31], [60, 61], [70, 2, 3, 4, 5], [6]]
    params = [SEEDED.with_updates(seed=100 + i, max_new_tokens=16, ignore_eos=True) for i in range(len(prompts))]
    roomy = RolloutEngine(spread_model, RolloutConfig(block_size=4, num_blocks=200)).generate(prompts, params)
    tight_engine = RolloutEngine(spread_model, RolloutConfig(block_size=4, num_blocks=blocks_for(5 + 16, 4) + 1))
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.stats.preemptions > 0
    for a, b in zip(roomy, tight):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_unseeded_sampling_is_reproducible_from_the_engine_seed(spread_model):
    prompts = [[5, 17, 42], [9, 9, 30], [5, 17, 42]]
    runs = [
        [
            o.completion_ids
            for o in RolloutEngine(spread_model, RolloutConfig(block_size=4, seed=s)).generate(prompts, OTHER)
        ]
        for s in (11, 11, 12)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
