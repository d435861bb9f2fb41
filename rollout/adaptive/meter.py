"""Decode steps planned and measured from outside the step: :class:`StepMeter` asks
:class:`StrategyChoice` which strategy a step runs, starts the step's own clock at its launch, and
when the loop retires the step hands the choice and the engine's statistics what it did and cost.
The step itself never looks at the selector.

A step's cost is its record's (``rollout/launched.py``, :class:`StepClock`): the host seconds of its
own launch and commit (others' commits inside its launch left out), and on CUDA the device seconds
between two events around its launch when they are more. No step's cost holds another's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..launched import Committed, Launched, StepClock
from ..model.graph_pool import capture_seconds
from ..stats import EngineStats, StepRecord
from .choice import DrafterLag, StepOutcome, StepPlan, StrategyChoice


class StepMeter:
    def __init__(
        self,
        choice: StrategyChoice,
        stats: EngineStats,
        tail_fraction: float,
        tokens_to_go: Callable[[Sequence], int],
        device: torch.device,
    ) -> None:
        self.choice, self.stats, self.tail_fraction, self.tokens_to_go = choice, stats, tail_fraction, tokens_to_go
        self.device = device
        self.lag = DrafterLag()
        self._peak_active = 0  # the wave's largest batch: a step of at most tail_fraction of it is in the tail

    def before_rollout(self, waiting: int) -> None:
        """Nothing runs: a new wave starts (``adaptive`` may calibrate for it)."""
        self.choice.before_rollout(waiting)
        self.lag.clear()
        self._peak_active = 0

    def plan(self, seqs: Sequence, in_flight: Launched | None = None) -> StepPlan:
        """The step's strategy; only ``adaptive`` weighs the remaining work, a drafter's catch-up
        (the tokens known in flight counted) and the sequences' mean context."""
        n = len(seqs)
        if not self.choice.strategy.adaptive:
            return self.choice.plan(n, n)
        context = sum(s.num_tokens for s in seqs) / n
        return self.choice.plan(n, self.tokens_to_go(seqs), self.lag.of(seqs, in_flight), context)

    def launch(self, plan: StepPlan, seqs: Sequence, launch: Callable[[], Launched | None]) -> Launched | None:
        """Launch a decode step of ``plan`` over ``seqs`` with its clock started. An arm is judged by
        its steady steps: one that captured a graph (the target's or the drafter's) or fed the
        model drafter a prompt teaches acceptance only."""
        stats = self.stats
        feeds_drafter = self.choice.strategy.adaptive and plan.strategy.uses_model_drafter
        meets_prompts = feeds_drafter and self.lag.meets_new(seqs)
        captured, commits, model_s = capture_seconds(), stats.commit_time_s, stats.model_time_s
        clock = StepClock(self.device)
        launched = launch()
        if launched is None:
            return None
        own = launched.commit_s  # a step committed inside its own launch
        clock.launched(stats.commit_time_s - commits - own)
        stats.decode_model_time_s += stats.model_time_s - model_s
        if feeds_drafter:  # what its drafter has seen: the sequences' tokens once it is committed
            launched.after_commit = lambda: self.lag.drafted(launched.seqs)
        captured = capture_seconds() - captured
        stats.capture_time_s += captured
        launched.clock, launched.plan = clock, Metered(plan, len(launched.seqs), meets_prompts or captured > 0)
        return launched

    def retire(self, launched: Launched) -> Committed:
        """The loop is done with ``launched``: commit it (if nothing did yet) and learn from it."""
        committed = launched.commit()
        metered = launched.plan
        if metered is None:  # a prefill
            return committed
        seconds, drafted = launched.clock.seconds(launched.commit_s), committed.drafted
        counts = (drafted.drafted, drafted.accepted, drafted.branches) if drafted is not None else ()
        forward = launched.forward_s
        outcome = StepOutcome(seconds, launched.draft_s, metered.one_off, *counts, forward_seconds=forward)
        self.choice.record(metered.plan, metered.batch, outcome)
        n = metered.batch
        self._peak_active = max(self._peak_active, n)
        in_tail = n <= self.tail_fraction * self._peak_active
        self.stats.record_decode_step(StepRecord(n, str(metered.plan.strategy), committed.emitted, seconds, in_tail))
        return committed


@dataclass(frozen=True)
class Metered:
    """What a decode step was launched under: its plan, its batch, and whether it teaches acceptance only."""

    plan: StepPlan
    batch: int
    one_off: bool
