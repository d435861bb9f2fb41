"""Tiny random-init models for tests and examples (no model hub needed).

``initializer_range`` is raised well above the usual 0.02 so logits are peaked: greedy choices
are then decided by the model rather than by float rounding between near-equal logits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # what the suite runs every check on
TINY_ARCHITECTURES = (*ARCHITECTURES, "mistral")  # what tiny_config builds (Mistral: its own checks)
T = TypeVar("T")


def across_architectures(cases: list[tuple]) -> list[tuple]:
    """Each case once, with the architectures in turn prepended (``(arch, *case)``): every case runs
    and every architecture runs about a third of them, where a full cross product would run each
    case on all three for behaviour that does not depend on the architecture."""
    return [(ARCHITECTURES[i % len(ARCHITECTURES)], *case) for i, case in enumerate(cases)]


def tiny_config(
    arch: str,
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    initializer_range: float = 0.2,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
    tie_word_embeddings: bool = False,
    sliding_window: int | None = None,
):
    """``sliding_window``: Mistral's (None: full attention)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // num_heads, **common)
    if arch == "mistral":
        return MistralConfig(sliding_window=sliding_window, **common)
    raise ValueError(f"arch must be one of {TINY_ARCHITECTURES}, got {arch!r}")


def tiny_random_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs):
    """A random-init causal LM of the given architecture, in eval mode, deterministic from ``seed``."""
    config = tiny_config(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def tiny_task_policy(tokenizer, seed: int = 3, initializer_range: float = 0.05):
    """A random-init tiny Qwen2 policy sized for ``tokenizer`` (the chain-sum task's, in the tests)."""
    return tiny_random_model(
        "qwen2",
        seed=seed,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
    )


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int = 0) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of relative size ``noise`` on every weight: a
    "good" drafter for tests (agrees with the model most of the time, not always)."""
    import copy

    clone = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clone.parameters():
            # drawn on the CPU, so a model on any device gets the same copy
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) * noise * p.std().clamp_min(1e-6))
    return clone.eval()


def random_prompts(n: int, seed: int, min_len: int = 1, max_len: int = 25, vocab: int = 96) -> list[list[int]]:
    """``n`` prompts of random lengths in ``[min_len, max_len]``, token ids in ``[2, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for length in lengths]


def stopping_params(model, prompts: list[list[int]], n: int = 20, stop_from: int = 2) -> list:
    """Greedy requests of lengths ``n - i % 4``, two in three of which stop early on a token of
    their own completion (at index ``stop_from + i % 5``): a batch whose sequences finish at
    different steps, each for its own reason (overlapped decoding then computes rows of
    sequences that had finished)."""
    from ..rollout import RolloutConfig, RolloutEngine, SamplingParams

    free = RolloutEngine(model, RolloutConfig(kv_cache_tokens=4096)).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    )
    return [
        SamplingParams(
            temperature=0.0,
            max_new_tokens=n - i % 4,
            stop_token_ids=[out.completion_ids[stop_from + i % 5]] if i % 3 else [],
        )
        for i, out in enumerate(free)
    ]


def generate_committing_each_step(engine, prompts: list[list[int]], params) -> list:
    """``engine``'s outputs with every step committed before the next is launched
    (``RolloutEngine.sync``): each step's inputs are the host's tokens, the reference a launched
    step's tokens must equal."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        engine.sync()
    return [engine.pop_output(i) for i in ids]


def with_synchronizations(call: Callable[[], T]) -> tuple[T, int]:
    """``call()``'s result and how many calls that wait for the device it made, as torch's CUDA
    sync debug mode counts them (an event's wait is not among them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < ``min_expected`` are merged.

    p = survival function of chi2(dof) = regularized upper incomplete gamma Q(dof/2, stat/2).
    """
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
    if len(obs_bins) < 2:
        return 1.0
    o, e = torch.tensor(obs_bins, dtype=torch.float64), torch.tensor(exp_bins, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    dof = len(obs_bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_id: int = 1) -> list[int]:
    """Batch-1 HF ``generate`` (greedy), cut after the first EOS (kept)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id if eos_id >= 0 else None,
            pad_token_id=0,
        )
    ids = out[0, len(prompt) :].tolist()
    if eos_id < 0:
        return ids
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids


def processed_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Each row's processed distribution (``params``: a ``SamplingParams``), float64 on the CPU."""
    from ..rollout.sampling import BatchSamplingTensors, processed_logprobs

    st = BatchSamplingTensors.from_params([params] * logits.shape[0], logits.device)
    return processed_logprobs(logits.float(), st).exp().double().cpu()


@torch.no_grad()
def exact_joint_of_tokens_2_and_3(model, prompt: list[int], vocab: int, params) -> torch.Tensor:
    """The target's processed joint of completion tokens 2 and 3 after ``prompt`` (the first
    speculative step's), marginalised over token 1: ``[vocab * vocab]``, what a chi-square test of
    sampled speculative decoding compares with."""
    dev = next(model.parameters()).device
    p1 = processed_probs(model(torch.tensor([prompt], device=dev)).logits[:, -1], params)[0]
    ctx2 = torch.tensor([prompt + [a] for a in range(vocab)], device=dev)
    p2 = processed_probs(model(ctx2).logits[:, -1], params)
    ctx3 = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)], device=dev)
    p3 = processed_probs(model(ctx3).logits[:, -1], params).view(vocab, vocab, vocab)
    return (p1.view(vocab, 1, 1) * p2.view(vocab, vocab, 1) * p3).sum(0).reshape(-1)
