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

from ..model.graph_pool import capture_seconds
from ..stats import EngineStats, StepRecord, StepResult
from .choice import DrafterLag, StepOutcome, StepPlan, StrategyChoice


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
        self._launched: tuple[StepPlan, int] | None = None  # the plan and batch of a step left in flight

    def before_rollout(self, waiting: int) -> None:
        """Nothing runs: a new wave starts (``adaptive`` may calibrate for it)."""
        self.choice.before_rollout(waiting)
        self.lag.clear()
        self._peak_active = 0
        self._launched = None

    def plan(self, seqs: Sequence) -> StepPlan:
        """The step's strategy; only ``adaptive`` weighs the remaining work, a drafter's catch-up
        and the sequences' mean context."""
        n = len(seqs)
        if not self.choice.strategy.adaptive:
            return self.choice.plan(n, n)
        context = sum(s.num_tokens for s in seqs) / n
        return self.choice.plan(n, self.tokens_to_go(seqs), self.lag.of(seqs), context)

    def run(self, plan: StepPlan, seqs: Sequence, unread: bool, step: Callable[[], StepResult]) -> list[int]:
        """Run ``step`` (a decode step of ``plan`` over ``seqs``), timed; return the requests it
        finished. ``unread``: the step reads no step before it (the first of an overlapped run), so
        its timer holds a launch, not a step. An arm is judged by its steady steps: one that captured
        a graph (the target's or the drafter's), fed the model drafter a prompt or read no step
        before it teaches acceptance only.

        A step launched and left in flight (a chain on the device) is learned from at the next
        step: that one's timer runs from its launch through the read of this one, which waits out
        this one's device work, and the read brings this one's accept lengths, so the outcome is
        recorded for this step's plan then. A step that reads one left in flight without being
        launched itself (another arm's) times both: it teaches acceptance only."""
        stats, n = self.stats, len(seqs)
        feeds_drafter = self.choice.strategy.adaptive and plan.strategy.uses_model_drafter
        # a chain left in flight is read in this step: its tokens are ones its drafter drafted for
        reads_launched = self.choice.strategy.adaptive and self._launched is not None
        meets_prompts = feeds_drafter and self.lag.meets_new(seqs)
        emitted, model_s, draft_s = stats.generated_tokens, stats.model_time_s, stats.draft_time_s
        captured = capture_seconds()
        start = time.perf_counter()
        result = step()
        seconds = time.perf_counter() - start
        stats.decode_model_time_s += stats.model_time_s - model_s
        if feeds_drafter or reads_launched:
            self.lag.drafted(seqs)
        captured = capture_seconds() - captured
        stats.capture_time_s += captured
        one_off = meets_prompts or captured > 0 or unread
        learned, sizes = plan, n  # the plan (and batch) the outcome belongs to
        if result.launched:
            (learned, sizes), self._launched = self._launched or (plan, n), (plan, n)
            one_off |= result.drafted is None  # nothing read: the timer holds a launch
        elif self._launched is not None:
            self._launched, one_off = None, True
        drafted = result.drafted
        counts = (drafted.drafted, drafted.accepted, drafted.branches) if drafted is not None else ()
        forward = stats.model_time_s - model_s if not result.launched else None  # launched: not the device's
        outcome = StepOutcome(seconds, stats.draft_time_s - draft_s, one_off, *counts, forward_seconds=forward)
        self.choice.record(learned, sizes, outcome)
        self._peak_active = max(self._peak_active, n)
        in_tail = n <= self.tail_fraction * self._peak_active
        stats.record_decode_step(StepRecord(n, str(plan.strategy), stats.generated_tokens - emitted, seconds, in_tail))
        return result.finished
