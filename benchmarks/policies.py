"""What the benchmarks run on: the shipped policies with their drafters, chain-sum prompts, and
one-thread measurement."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..tasks.chain_sum import ChainSumConfig, ChainSumProblem, sample_problems
from ..tasks.sft import count_parameters, load_shipped, load_shipped_eagle3
from ..trainer_hooks.spec_rollout import SpecRollout


def task_problems(num: int, seed: int) -> list[ChainSumProblem]:
    return sample_problems(num, seed=seed, cfg=ChainSumConfig())


def prompts_of(problems: list[ChainSumProblem], tokenizer) -> list[list[int]]:
    conversations = [[{"role": "user", "content": p.question}] for p in problems]
    return SpecRollout.tokenize_prompts(conversations, tokenizer)


def task_prompts(tokenizer, num: int, seed: int) -> list[list[int]]:
    return prompts_of(task_problems(num, seed), tokenizer)


@dataclass
class BenchPolicy:
    """A shipped policy with its drafters: ``tiny`` (4 x 256, for tests) or ``deep`` (24 x 256)."""

    name: str
    model: Any
    tokenizer: Any
    head: Any  # its EAGLE-3 head
    drafter_lm: Any

    @classmethod
    def load(cls, name: str) -> BenchPolicy:
        model, tokenizer = load_shipped(name, "policy")
        return cls(name, model, tokenizer, load_shipped_eagle3(name), load_shipped(name, "drafter")[0])

    def describe(self) -> str:
        c = self.model.config
        params = count_parameters(self.model) / 1e6
        shape = f"{c.num_hidden_layers} layers x hidden {c.hidden_size}, {params:.1f}M parameters"
        return f"the shipped {self.name} policy ({shape})"


@contextmanager
def torch_threads(n: int):
    """Measure with ``n`` intra-op threads (one per process gives the steadiest ratios on a shared CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
