import functools

import pytest
import torch

from tailspec.testing import ARCHITECTURES, tiny_random_model
from tailspec.testing import random_prompts as testing_random_prompts

EOS = 1
VOCAB = 96


@functools.cache
def cached_model(arch: str, seed: int = 1, initializer_range: float = 0.2):
    return tiny_random_model(arch, seed=seed, initializer_range=initializer_range)


@pytest.fixture(params=ARCHITECTURES)
def arch_model(request):
    return cached_model(request.param)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_id: int = EOS) -> list[int]:
    """Batch-1 HF generate, cut after the first EOS (kept)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id if eos_id >= 0 else None,
            pad_token_id=0,
        )
    ids = out[0, len(prompt) :].tolist()
    if eos_id < 0:
        return ids
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids


def random_prompts(n: int, seed: int, min_len: int = 1, max_len: int = 25) -> list[list[int]]:
    return testing_random_prompts(n, seed, min_len, max_len, VOCAB)


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
