"""Accuracy of sampled answers: majority vote and pass@k with a task's verifier."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from ``num_correct`` of ``num_samples``: 1 - C(n - c, k) / C(n, k)."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be in [1, num_samples={num_samples}], got {k}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, {num_samples}], got {num_correct}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def majority_vote(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most common non-None answer (ties go to the one seen first); None if there is none."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


@dataclass(frozen=True)
class Accuracy:
    majority: float  # fraction of questions whose majority answer is correct
    pass_at_1: float
    pass_at_k: float
    k: int
    num_questions: int


def score_answers(
    completions: Sequence[Sequence[str]],
    references: Sequence[Hashable],
    extract: Callable[[str], Hashable | None],
    k: int | None = None,
) -> Accuracy:
    """``completions[q]`` are question ``q``'s sampled texts; ``extract`` reads an answer from a text."""
    if len(completions) != len(references):
        raise ValueError(f"got completions for {len(completions)} questions but {len(references)} references")
    if not completions:
        raise ValueError("no questions to score")
    n = len(completions[0])
    if n == 0 or any(len(c) != n for c in completions):
        raise ValueError("every question needs the same, non-zero number of samples")
    k = n if k is None else k
    majority = p1 = pk = 0.0
    for texts, ref in zip(completions, references):
        answers = [extract(t) for t in texts]
        correct = sum(a is not None and a == ref for a in answers)
        majority += float(majority_vote(answers) == ref)
        p1 += pass_at_k(n, correct, 1)
        pk += pass_at_k(n, correct, k)
    q = len(completions)
    return Accuracy(majority / q, p1 / q, pk / q, k, q)
