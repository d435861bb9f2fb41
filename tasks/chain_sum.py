"""The chain-sum task: add a list of digits with a chain of thought of running sums.

``add 3 5 2 7`` → ``3+5=8 8+2=10 10+7=17 answer 17``. The answer is verifiable, which gives a
reward for RL. The number of terms ``n`` is heavy-tailed, so rollouts have a real long tail:

* with probability ``1 - long_fraction`` n comes from a power law, P(n) ∝ n^-tail_exponent on
  ``[min_terms, long_min_terms - 1]`` (mostly n = 2..5: responses of 15-40 characters);
* with probability ``long_fraction`` the problem is long: n is uniform on
  ``[long_min_terms, max_terms]`` (responses of 120-370 characters, 10-25x the median).

A pure truncated power law cannot make both the body short and the tail long enough (its 95th
percentile length stays under ~7x the median for any exponent), hence the explicit long
component. With ``long_fraction=0`` the distribution is the plain power law on
``[min_terms, max_terms]``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

_MAX_TERMS_LIMIT = 200
LAYOUTS = ("chain", "lines")  # response formats (ChainSumProblem.solution_in)
_DIGITS = frozenset("0123456789")


@dataclass(frozen=True)
class ChainSumConfig:
    """The distribution of chain-sum problems (see the module docstring)."""

    min_terms: int = 2
    max_terms: int = 40
    tail_exponent: float = 2.0
    long_fraction: float = 0.1
    long_min_terms: int = 15

    def __post_init__(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not (is_int(self.min_terms) and 2 <= self.min_terms <= _MAX_TERMS_LIMIT):
            raise ValueError(f"min_terms must be an int in [2, {_MAX_TERMS_LIMIT}], got {self.min_terms!r}")
        if not (is_int(self.max_terms) and self.min_terms <= self.max_terms <= _MAX_TERMS_LIMIT):
            raise ValueError(
                f"max_terms must be an int in [min_terms={self.min_terms}, {_MAX_TERMS_LIMIT}], got {self.max_terms!r}"
            )
        if not (isinstance(self.tail_exponent, (int, float)) and 0 < self.tail_exponent <= 10):
            raise ValueError(f"tail_exponent must be a number in (0, 10], got {self.tail_exponent!r}")
        if not (isinstance(self.long_fraction, (int, float)) and 0 <= self.long_fraction < 1):
            raise ValueError(f"long_fraction must be a number in [0, 1), got {self.long_fraction!r}")
        if self.long_fraction > 0 and not (
            is_int(self.long_min_terms) and self.min_terms < self.long_min_terms <= self.max_terms
        ):
            raise ValueError(
                f"long_min_terms must be an int in (min_terms={self.min_terms}, max_terms={self.max_terms}] "
                f"when long_fraction > 0, got {self.long_min_terms!r} (set long_fraction=0 for a plain power law)"
            )

    @cached_property
    def _body(self) -> tuple[list[int], list[float]]:
        top = self.long_min_terms - 1 if self.long_fraction > 0 else self.max_terms
        ns = list(range(self.min_terms, top + 1))
        return ns, [n**-self.tail_exponent for n in ns]

    def probabilities(self) -> dict[int, float]:
        """P(n) for every number of terms n with non-zero probability."""
        ns, weights = self._body
        total = sum(weights)
        probs = {n: (1 - self.long_fraction) * w / total for n, w in zip(ns, weights)}
        if self.long_fraction > 0:
            span = self.max_terms - self.long_min_terms + 1
            for n in range(self.long_min_terms, self.max_terms + 1):
                probs[n] = self.long_fraction / span
        return probs

    def sample_num_terms(self, rng: random.Random) -> int:
        if self.long_fraction > 0 and rng.random() < self.long_fraction:
            return rng.randint(self.long_min_terms, self.max_terms)
        ns, weights = self._body
        return rng.choices(ns, weights)[0]


@dataclass(frozen=True)
class ChainSumProblem:
    """One problem: the digits to add, in order."""

    terms: tuple[int, ...]

    @classmethod
    def from_question(cls, question: str) -> ChainSumProblem:
        """The problem a question states (``"add 3 5 2 7"``); a ``ValueError`` says what is wrong."""
        words = question.split() if isinstance(question, str) else []
        if len(words) < 2 or words[0] != "add" or not all(w in _DIGITS for w in words[1:]):
            raise ValueError(f"a chain-sum question is 'add' followed by single digits 0-9, got {question!r}")
        if len(words) - 1 > _MAX_TERMS_LIMIT:
            raise ValueError(f"a chain-sum question has at most {_MAX_TERMS_LIMIT} terms, got {len(words) - 1}")
        return cls(tuple(int(w) for w in words[1:]))

    @property
    def question(self) -> str:
        """The user message, e.g. ``add 3 5 2 7``."""
        return "add " + " ".join(str(t) for t in self.terms)

    @property
    def answer(self) -> int:
        return sum(self.terms)

    @property
    def solution(self) -> str:
        """The reference response (no EOS), e.g. ``3+5=8 8+2=10 10+7=17 answer 17``."""
        return self.solution_in("chain")

    def solution_in(self, layout: str) -> str:
        """The reference response in a :data:`LAYOUTS` layout: ``chain`` (the policies' own,
        ``3+5=8 8+2=10 answer 10``) or ``lines`` (a step per line, spaced operators, ``answer:``:
        ``3 + 5 = 8\n8 + 2 = 10\nanswer: 10``), the same sums in another format (a policy
        fine-tuned to it is a format shift for its drafters)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        steps, total = [], self.terms[0]
        for t in self.terms[1:]:
            steps.append(f"{total}+{t}={total + t}" if layout == "chain" else f"{total} + {t} = {total + t}")
            total += t
        if layout == "chain":
            return " ".join([*steps, f"answer {total}"])
        return "\n".join([*steps, f"answer: {total}"])


def sample_problem(
    rng: random.Random, cfg: ChainSumConfig | None = None, num_terms: int | None = None
) -> ChainSumProblem:
    """A problem with ``num_terms`` terms, or a number of terms drawn from ``cfg``."""
    cfg = cfg if cfg is not None else ChainSumConfig()
    n = num_terms if num_terms is not None else cfg.sample_num_terms(rng)
    if n < 1:
        raise ValueError(f"num_terms must be >= 1, got {n}")
    return ChainSumProblem(tuple(rng.randint(0, 9) for _ in range(n)))


def sample_problems(n: int, seed: int, cfg: ChainSumConfig | None = None) -> list[ChainSumProblem]:
    """``n`` problems, deterministic given ``seed`` and ``cfg``."""
    rng = random.Random(seed)
    return [sample_problem(rng, cfg) for _ in range(n)]


_ANSWER = re.compile(r"\banswer:? (-?\d+)")


def extract_answer(text: Any) -> int | None:
    """The integer after the last ``answer `` (or ``answer: ``) in ``text``, or None (also for non-strings)."""
    if not isinstance(text, str):
        return None
    found = _ANSWER.findall(text)
    if not found:
        return None
    try:
        return int(found[-1])
    except ValueError:  # e.g. more digits than Python's int-from-str limit
        return None


def _completion_text(completion: Any) -> str | None:
    """The text of a completion: a string, or the content of a conversation's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else None
    return None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def chain_sum_reward(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: 1.0 where the completion's final answer equals ``answer``, else 0.0.

    ``completions`` are strings or conversations (lists of ``{"role", "content"}`` messages, the
    last one is scored); ``answer`` is the dataset column (ints or numeric strings). Other dataset
    columns arrive in ``kwargs`` and are ignored.
    """
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
    rewards = []
    for completion, expected in zip(completions, answer):
        got = extract_answer(_completion_text(completion))
        want = _as_int(expected)
        rewards.append(1.0 if got is not None and got == want else 0.0)
    return rewards


def make_grpo_dataset(
    num_prompts: int,
    seed: int,
    cfg: ChainSumConfig | None = None,
    conversational: bool = True,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Dataset:
    """A ``datasets.Dataset`` of ``num_prompts`` sampled problems for GRPO: columns ``prompt``,
    ``answer`` (int), ``num_terms``.

    ``prompt`` is ``[{"role": "user", "content": question}]`` when ``conversational``, else the
    question rendered by the chat template with the generation prompt (``<|user|>add 1 2<|assistant|>``;
    ``tokenizer`` defaults to the tiny tokenizer).
    """
    return grpo_dataset_of(sample_problems(num_prompts, seed, cfg), conversational, tokenizer)


def grpo_dataset_of(
    problems: Sequence[ChainSumProblem],
    conversational: bool = True,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Dataset:
    """:func:`make_grpo_dataset`'s columns for the given problems, in their order."""
    from datasets import Dataset

    if not conversational and tokenizer is None:
        from .tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
    rows = []
    for p in problems:
        conversation = [{"role": "user", "content": p.question}]
        if conversational:
            prompt: Any = conversation
        else:
            prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        rows.append({"prompt": prompt, "answer": p.answer, "num_terms": len(p.terms)})
    return Dataset.from_list(rows)
