"""Sampled speculative decoding emits exactly the target's processed distribution.

For a fixed prompt, the engine generates many completions of 4 tokens; the first comes from the
prefill, the next two from one speculative step (accepted drafts, a correction, or the bonus
token). The empirical joint distribution of tokens 2 and 3 is compared (chi-square) with the
exact one computed from the target's processed distributions, marginalised over token 1.
"""

import functools

import pytest
import torch
from rollout_helpers import chi_square_pvalue

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from tailspec.kernels.dispatch import kernel_backend
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.spec import verdicts as verdicts_module
from tailspec.rollout.spec import verify as verify_module
from tailspec.testing import exact_joint_of_tokens_2_and_3 as exact_joint
from tailspec.testing import perturbed_copy, processed_probs, tiny_random_model

V = 12
N = 2000  # samples per check: a wrong residual rule fails it at p ~ 1e-31 (test_the_check_rejects_a_wrong_residual)
PROMPT = [3, 7, 2, 9, 5]


@functools.cache
def target():
    return tiny_random_model("llama", seed=3, vocab_size=V, initializer_range=0.06)


@functools.cache
def drafter_model(kind: str):
    if kind == "good":
        return perturbed_copy(target(), noise=0.5, seed=1)
    return tiny_random_model("llama", seed=99, vocab_size=V, initializer_range=0.3, num_layers=1)


@functools.cache
def eagle3_head():
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target().config))
    head.reset_parameters(std=0.3)
    return head.eval()


def drafter(kind):
    """A fresh drafter per engine (the EAGLE-3 drafter holds per-sequence state); a drafter
    object passes through."""
    if not isinstance(kind, str):
        return kind
    if kind == "eagle3":
        return Eagle3Drafter(eagle3_head(), target())
    return drafter_model(kind)


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return processed_probs(logits, params)


@functools.cache
def exact_joint_of_tokens_2_and_3(params: SamplingParams) -> torch.Tensor:
    return exact_joint(target(), PROMPT, V, params)


def joint_counts(
    strategy: str,
    kind: str | None,
    params: SamplingParams,
    seed: int = 0,
    verify_kernel: str = "auto",
    n: int = N,
) -> torch.Tensor:
    config = RolloutConfig(strategy=strategy, seed=seed, max_num_seqs=n, block_size=4, kv_cache_tokens=n * 16)
    engine = RolloutEngine(target(), config, drafter=drafter(kind) if kind else None)
    with kernel_backend(verify_kernel, kernels=("verify",)):
        outs = engine.generate([PROMPT] * n, params.with_updates(max_new_tokens=4, ignore_eos=True))
    assert engine.stats.drafted_tokens > 0
    pairs = torch.tensor([o.completion_ids[1] * V + o.completion_ids[2] for o in outs])
    return torch.bincount(pairs, minlength=V * V)


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.9),
    SamplingParams(temperature=0.7, min_p=0.1),
]


SETTING = dict(zip(["T1", "T0.7", "T1-topk-topp", "T0.7-minp"], SETTINGS))
# (strategy, drafter, settings): every strategy kind and every drafter meets every sampling setting
# (the processed distribution is verify's, shared by all of them), without the full cross product
COVERING = [
    ("chain:2", "good", ("T1", "T0.7-minp")),
    ("chain:2", "bad", ("T0.7", "T1-topk-topp")),
    ("tree:2,3,6", "good", ("T0.7", "T1-topk-topp")),
    ("tree:2,3,6", "bad", ("T1", "T0.7-minp")),
    ("chain:2", "eagle3", ("T1", "T0.7")),
    ("tree:2,3,6", "eagle3", ("T1-topk-topp", "T0.7-minp")),
    ("hybrid:2,2,6", "good", ("T1-topk-topp", "T0.7-minp")),
]


@pytest.mark.parametrize(
    "strategy,kind,params",
    [
        pytest.param(s, k, SETTING[name], id=f"{s.split(':')[0]}-{k}-{name}")
        for s, k, names in COVERING
        for name in names
    ],
)
def test_speculative_samples_follow_the_target(strategy, kind, params):
    counts = joint_counts(strategy, kind, params)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(params)) > 1e-3


# the engine's one call of the kernel (steps drafted from the host's text), with trees mixing one-hot
# and sampled drafts (hybrid); tests/kernels/test_tree_verify.py checks every decision against the torch rule (chains,
# trees, mixed, filtered targets), and the test below runs an EAGLE-3 tree through both kernels
@pytest.mark.parametrize(
    "strategy,kind,params",
    [("hybrid:2,2,6", "bad", SETTINGS[0]), ("hybrid:2,2,6", "good", SETTINGS[1])],
    ids=["hybrid-bad-T1", "hybrid-T0.7"],
)
def test_triton_verify_kernel_draws_the_same_samples(strategy, kind, params):
    """The fused verification kernel (interpreter without CUDA) consumes the same uniforms as the
    torch rule and decides identically, so a seeded engine samples the same completions: with the
    chi-square tests of the torch rule above, the kernel's samples follow the target too."""
    pytest.importorskip("triton")
    prompts = [PROMPT[: 1 + i % 5] for i in range(8)]
    outputs = []
    for backend in ("torch", "triton"):
        engine = RolloutEngine(target(), RolloutConfig(strategy=strategy, seed=5), drafter=drafter(kind))
        with kernel_backend(backend, kernels=("verify",)):
            outs = engine.generate(prompts, params.with_updates(max_new_tokens=8, ignore_eos=True))
        # the kernel decided both ways: drafts accepted and drafts rejected
        assert engine.stats.drafted_tokens > engine.stats.accepted_tokens > 0
        outputs.append([(o.completion_ids, o.num_accepted) for o in outs])
    assert outputs[0] == outputs[1]


def test_triton_attention_and_verify_kernels_draw_the_same_samples():
    """Both kernels (the target's and the EAGLE-3 head's attention too): the same seeded samples
    as the torch path (attention differs from SDPA only by float rounding)."""
    pytest.importorskip("triton")
    prompts = [PROMPT[: 1 + i % 5] for i in range(6)]
    params = SETTINGS[1].with_updates(max_new_tokens=6, ignore_eos=True)
    outputs = []
    for backend in ("torch", "triton"):
        config = RolloutConfig(strategy="tree:2,3,6", seed=3, kernels=backend)
        engine = RolloutEngine(target(), config, drafter=drafter("eagle3"))
        outputs.append([(o.completion_ids, o.num_accepted) for o in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_suffix_drafter_samples_follow_the_target():
    params = SamplingParams(temperature=1.0)
    counts = joint_counts("suffix:2,2,4", None, params)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(params)) > 1e-3


def test_plain_decoding_passes_the_same_check():
    params = SamplingParams(temperature=1.0)
    engine = RolloutEngine(target(), RolloutConfig(max_num_seqs=N, block_size=4, kv_cache_tokens=N * 16))
    outs = engine.generate([PROMPT] * N, params.with_updates(max_new_tokens=3, ignore_eos=True))
    counts = torch.bincount(
        torch.tensor([o.completion_ids[1] * V + o.completion_ids[2] for o in outs]), minlength=V * V
    )
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(params)) > 1e-3


def test_the_check_rejects_a_wrong_residual(monkeypatch):
    """Resampling from the target instead of the residual after a rejection biases the output
    towards the drafter; the check above must catch it."""
    monkeypatch.setattr(verify_module, "residual", lambda p, q, token: p)  # a tree walked on its own
    monkeypatch.setattr(verdicts_module, "chain_residual", lambda p, q: p)  # chains verified together
    params = SamplingParams(temperature=1.0)
    counts = joint_counts("chain:2", "bad", params)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(params)) < 1e-6


def test_streamed_samples_follow_the_target():
    """Speculative streaming: a chain's second token comes from a streaming head of the same
    forward, drawn from that head's distribution, its third from the forward that fed both; the
    output is still exactly the target's, drafted from state on the device."""
    from tailspec.drafter.small_lm import SmallLMDrafter
    from tailspec.drafter.streaming import StreamingHeads

    bad = drafter_model("bad")
    torch.manual_seed(3)
    heads = StreamingHeads(bad.config.hidden_size, 1)
    torch.nn.init.normal_(heads.blocks[0].weight, std=0.3)
    params = SamplingParams(temperature=1.0)
    drafter = SmallLMDrafter(bad, streaming_heads=heads, kv_cache_tokens=N * 16)
    counts = joint_counts("chain:3", drafter, params)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(params)) > 1e-3
