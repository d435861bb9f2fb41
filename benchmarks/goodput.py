"""Goodput per batch-size bucket: a run's decode steps grouped by how many sequences were active
(the adaptive selector's buckets), for the adaptive benchmark and the GPU pack's speed stage."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..rollout.stats import StepRecord


@dataclass
class BucketGoodput:
    """Decode steps of one run that fell in one batch-size bucket."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    arms: dict[str, int] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def goodput_by_bucket(steps: Sequence[StepRecord], bounds: Sequence[int]) -> dict[int, BucketGoodput]:
    """Emitted tokens and step time per bucket of active sequences (the selector's buckets: a
    bound holds the batch sizes above the previous bound, up to itself; the last holds the rest)."""
    out: dict[int, BucketGoodput] = {}
    for s in steps:
        bound = bounds[min(bisect_left(bounds, s.num_active), len(bounds) - 1)]
        b = out.setdefault(bound, BucketGoodput())
        b.tokens += s.emitted
        b.seconds += s.seconds
        b.steps += 1
        b.arms[s.strategy] = b.arms.get(s.strategy, 0) + 1
    return out
