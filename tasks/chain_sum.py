"""The chain-sum task: add a list of digits with a chain of thought of running sums.

``add 3 5 2 7`` → ``3+5=8 8+2=10 10+7=17 answer 17``. The number of terms is heavy-tailed
(P(n) ∝ n^-tail_exponent on [min_terms, max_terms]), so most responses are short and a few are
10-30x longer: rollouts have a real long tail. The answer is verifiable, giving a reward.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class ChainSumConfig:
    min_terms: int = 2
    max_terms: int = 40
    tail_exponent: float = 1.8

    def __post_init__(self) -> None:
        if not (isinstance(self.min_terms, int) and self.min_terms >= 2):
            raise ValueError(f"min_terms must be an int >= 2, got {self.min_terms!r}")
        if not (isinstance(self.max_terms, int) and self.min_terms <= self.max_terms <= 200):
            raise ValueError(f"max_terms must be an int in [min_terms={self.min_terms}, 200], got {self.max_terms!r}")
        if not (isinstance(self.tail_exponent, (int, float)) and 0 < self.tail_exponent <= 10):
            raise ValueError(f"tail_exponent must be in (0, 10], got {self.tail_exponent!r}")

    @cached_property
    def _weights(self) -> tuple[list[int], list[float]]:
        ns = list(range(self.min_terms, self.max_terms + 1))
        return ns, [n**-self.tail_exponent for n in ns]


@dataclass(frozen=True)
class ChainSumProblem:
    terms: tuple[int, ...]

    @property
    def question(self) -> str:
        return "add " + " ".join(str(t) for t in self.terms)

    @property
    def answer(self) -> int:
        return sum(self.terms)

    @property
    def solution(self) -> str:
        steps, total = [], self.terms[0]
        for t in self.terms[1:]:
            steps.append(f"{total}+{t}={total + t}")
            total += t
        return " ".join(steps) + f" answer {total}"


def sample_problem(
    rng: random.Random, cfg: ChainSumConfig = ChainSumConfig(), num_terms: int | None = None
) -> ChainSumProblem:
    ns, weights = cfg._weights
    n = num_terms if num_terms is not None else rng.choices(ns, weights)[0]
    return ChainSumProblem(tuple(rng.randint(0, 9) for _ in range(n)))


def sample_problems(n: int, seed: int, cfg: ChainSumConfig = ChainSumConfig()) -> list[ChainSumProblem]:
    rng = random.Random(seed)
    return [sample_problem(rng, cfg) for _ in range(n)]


_ANSWER = re.compile(r"answer (-?\d+)")


def extract_answer(text: str) -> int | None:
    """The integer after the last ``answer`` in ``text``, or None."""
    found = _ANSWER.findall(text or "")
    return int(found[-1]) if found else None


def _completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return ""


def chain_sum_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion's final answer is correct, else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        got = extract_answer(_completion_text(completion))
        rewards.append(1.0 if got is not None and got == int(expected) else 0.0)
    return rewards


def make_grpo_dataset(num_prompts: int, seed: int, cfg: ChainSumConfig = ChainSumConfig(), conversational: bool = True):
    """A ``datasets.Dataset`` with ``prompt`` (a conversation, or the raw question) and ``answer``."""
    from datasets import Dataset

    rows = []
    for p in sample_problems(num_prompts, seed, cfg):
        prompt = [{"role": "user", "content": p.question}] if conversational else p.question
        rows.append({"prompt": prompt, "answer": p.answer, "num_terms": len(p.terms)})
    return Dataset.from_list(rows)
