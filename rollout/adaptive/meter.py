"""Decode steps planned and measured from outside the step: :class:`StepMeter` asks
:class:`StrategyChoice` which strategy a step runs, times the step, and hands the choice and the
engine's statistics what it did. The step itself never looks at the selector.

The timer adds no wait of its own: a step's read of its tokens already waits for the device
(overlapped, a step's timer holds its launch and the read of the step before it, which waits out
that step's device work).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..model.graph_pool import capture_seconds
from ..stats import EngineStats, StepRecord
from .choice import DrafterLag, StepOutcome, StepPlan, StrategyChoice


@dataclass(frozen=True)
class Drafted:
    """A speculative step's drafts, per sequence: the draft tokens verified, how many were
    accepted, and its tree's first branch (depth, kept): what ``adaptive`` learns acceptance from."""

    drafted: list[int]
    accepted: list[int]
    branches: list[tuple[int, int]]


class StepMeter:
    def __init__(
        self,
        choice: StrategyChoice,
        stats: EngineStats,
        tail_fraction: float,
        tokens_to_go: Callable[[Sequence], int],
    ) -> None:
        self.choice, self.stats, self.tail_fraction, self.tokens_to_go = choice, stats, tail_fraction, tokens_to_go
        self.lag = DrafterLag()
        self._peak_active = 0  # the wave's largest batch: a step of at most tail_fraction of it is in the tail

    def before_rollout(self, waiting: int) -> None:
        """Nothing runs: a new wave starts (``adaptive`` may calibrate for it)."""
        self.choice.before_rollout(waiting)
        self.lag.clear()
        self._peak_active = 0

    def plan(self, seqs: Sequence) -> StepPlan:
        """The step's strategy; only ``adaptive`` weighs the remaining work and a drafter's catch-up."""
        n = len(seqs)
        adaptive = self.choice.strategy.adaptive
        return self.choice.plan(n, *((self.tokens_to_go(seqs), self.lag.of(seqs)) if adaptive else (n, 0)))

    def run(self, plan: StepPlan, seqs: Sequence, unread: bool, step: Callable[[], tuple[list, Drafted | None]]):
        """Run ``step`` (a decode step of ``plan`` over ``seqs``), timed; return what it returns
        first. ``unread``: the step reads no step before it (the first of an overlapped run), so its
        timer holds a launch, not a step. An arm is judged by its steady steps: one that captured a
        graph (the target's or the drafter's), fed the model drafter a prompt or read no step before
        it teaches acceptance only."""
        stats, n = self.stats, len(seqs)
        feeds_drafter = self.choice.strategy.adaptive and plan.strategy.uses_model_drafter
        meets_prompts = feeds_drafter and self.lag.meets_new(seqs)
        emitted, model_s, draft_s = stats.generated_tokens, stats.model_time_s, stats.draft_time_s
        captured = capture_seconds()
        start = time.perf_counter()
        done, drafted = step()
        seconds = time.perf_counter() - start
        stats.decode_model_time_s += stats.model_time_s - model_s
        if feeds_drafter:
            self.lag.drafted(seqs)
        captured = capture_seconds() - captured
        stats.capture_time_s += captured
        one_off = meets_prompts or captured > 0 or unread
        counts = (drafted.drafted, drafted.accepted, drafted.branches) if drafted is not None else ()
        self.choice.record(plan, n, StepOutcome(seconds, stats.draft_time_s - draft_s, one_off, *counts))
        self._peak_active = max(self._peak_active, n)
        in_tail = n <= self.tail_fraction * self._peak_active
        stats.record_decode_step(StepRecord(n, str(plan.strategy), stats.generated_tokens - emitted, seconds, in_tail))
        return done
