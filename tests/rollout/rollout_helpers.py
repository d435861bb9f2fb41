"""Helpers the rollout tests import (a module of its own: ``conftest`` is a name every test
folder's conftest shares, so importing from it breaks when pytest collects several folders)."""

import functools

from tailspec.testing import chi_square_pvalue, hf_greedy, tiny_random_model  # noqa: F401 (used by tests)
from tailspec.testing import random_prompts as testing_random_prompts

EOS = 1
VOCAB = 96


@functools.cache
def cached_model(arch: str, seed: int = 1, initializer_range: float = 0.2):
    return tiny_random_model(arch, seed=seed, initializer_range=initializer_range)


def random_prompts(n: int, seed: int, min_len: int = 1, max_len: int = 25) -> list[list[int]]:
    return testing_random_prompts(n, seed, min_len, max_len, VOCAB)
