"""Which strategy each decode step runs: the configured one, or, for ``adaptive``, the selector's
pick from calibrated step costs and pooled acceptance (``rollout/adaptive/selector.py``), with what each
step teaches it.

The engine asks :meth:`StrategyChoice.plan` before a decode step and hands the step's outcome to
:meth:`StrategyChoice.record` after it; it never talks to the selector itself. The selector's
step costs are calibrated before its first rollout (``calibrate``: the engine's forward timer) up
to the batch that rollout can reach, extended before a later rollout that can reach a larger one,
and timed again between rollouts once the arms run far off them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...draft_contract import Drafter, TimesDraftLevels, Versioned
from ..launched import Launched
from ..params import RolloutConfig
from ..stats import EngineCounts
from ..strategy import Strategy, parse_strategy
from .cost_model import StepCosts
from .forward_table import ForwardTable
from .selector import SelectorConfig, StrategySelector

logger = logging.getLogger(__name__)

# (config, arms, max batch, the table to extend or None, fresh) -> the forward's seconds per shape
Calibrate = Callable[[SelectorConfig, Sequence[Strategy], int, ForwardTable | None, bool], ForwardTable]


def calibrated_batch(requests: int, max_num_seqs: int) -> int:
    """The batch a calibration covers for a rollout of ``requests``: the next power of two (so a
    table grows a few times at most), within ``max_num_seqs``."""
    return min(max_num_seqs, 1 << max(requests - 1, 0).bit_length())


@dataclass(frozen=True)
class StepPlan:
    """A decode step's strategy, the tokens its model drafter must catch up on first (emitted by
    steps of other arms since it last drafted), and for ``adaptive`` its sequences' mean context
    (what it was priced at, and what its outcome is judged against)."""

    strategy: Strategy
    lag_tokens: int = 0
    context: float | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What a decode step did: its seconds, the drafting's share, whether it paid a one-time cost
    (a graph captured, a model drafter's first look at a sequence's prompt: then neither time is the
    arm's), and per sequence the draft tokens verified and accepted, and its tree's first branch
    (depth, kept) (None for a plain step)."""

    seconds: float
    draft_seconds: float = 0.0
    one_off: bool = False
    drafted: list[int] | None = None
    accepted: list[int] | None = None
    branches: list[tuple[int, int]] | None = None
    forward_seconds: float | None = None  # the target forward's share of ``seconds`` (None: not measured)


class DrafterLag:
    """Tokens each running sequence emitted since the model drafter last drafted for it: what a
    step of a model arm must catch up on first, and only a model arm, since steps of other arms
    made it (finished sequences owe nothing). A sequence's prompt is not counted: every arm that
    drafts with the model pays it once, at its first draft of the sequence, whichever arm ran
    before; such a step is a one-off (:meth:`meets_new`) and teaches no costs."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}  # seq id -> its tokens when the drafter last drafted for it

    def of(self, seqs: Sequence, in_flight: Launched | None = None) -> int:
        """What ``seqs`` emitted since their last draft, the tokens known in flight included."""
        unread = in_flight.unread if in_flight is not None else (lambda seq: 0)
        emitted = [(s.seq_id, s.num_tokens + unread(s)) for s in seqs]
        return sum(now - self._seen.get(seq_id, now) for seq_id, now in emitted)

    def meets_new(self, seqs: Sequence) -> bool:
        """Whether the model drafter has not drafted yet for one of ``seqs`` (it feeds the prompt)."""
        return any(s.seq_id not in self._seen for s in seqs)

    def drafted(self, seqs: Sequence) -> None:
        for s in seqs:
            self._seen[s.seq_id] = s.num_tokens

    def clear(self) -> None:
        self._seen.clear()


class StrategyChoice:
    """The configured strategy (:meth:`set`), and for ``adaptive`` the selector that picks an arm
    per step; the selector is made on first need and kept across calls and strategy changes
    (what it measured is the engine's learned state)."""

    def __init__(
        self, config: RolloutConfig, drafter: Drafter | None, calibrate: Calibrate, stats: EngineCounts | None = None
    ) -> None:
        self.config = config
        self.stats = stats if stats is not None else EngineCounts()  # its calibration_time_s: what calibrating took
        self.has_model_drafter = drafter is not None
        # a drafter trained online changes version: what its arms measured then counts less
        self._versioned = drafter if isinstance(drafter, Versioned) else None
        # one that times its draft levels: its arms' drafting is priced from that before they run
        self._timed_drafter = drafter if isinstance(drafter, TimesDraftLevels) else None
        self._calibrate = calibrate
        self.strategy = Strategy("none")
        self.selector: StrategySelector | None = None
        self.covered_batch = 0  # the largest batch the selector's forward table was timed at
        self.largest_batch = 0  # the most sequences a decode step of this engine ran
        self.expected_batch = 0  # the batch a caller said its next rollouts reach (:meth:`expect`)

    def set(self, strategy: str | Strategy) -> Strategy:
        parsed = parse_strategy(strategy)
        if parsed.uses_model_drafter and not self.has_model_drafter:
            raise ValueError(
                f"strategy {str(parsed)!r} needs a drafter model; pass drafter=... to the engine "
                "(or use 'none' or 'suffix')"
            )
        if parsed.adaptive:
            self.ensure_selector()
        self.strategy = parsed
        return parsed

    @property
    def arms(self) -> list[Strategy]:
        """The strategies this engine's steps can run now."""
        if self.strategy.adaptive and self.selector is not None:
            return list(self.selector.arms)
        return [self.strategy]

    def ensure_selector(self) -> StrategySelector:
        if self.selector is None:
            self.selector = StrategySelector(self.config.selector, has_model_drafter=self.has_model_drafter)
            if not self.has_model_drafter and self.selector.dropped_arms:
                logger.warning(
                    "strategy 'adaptive' has no model drafter, so it chooses among %s only and drops %s: "
                    "pass drafter= (a smaller LM, an EAGLE-3 head or 'self:L') for the drafting arms that pay most",
                    [str(a) for a in self.selector.arms],
                    [str(a) for a in self.selector.dropped_arms],
                )
        return self.selector

    def calibrate(self, up_to: int | None = None, fresh: bool = True) -> None:
        """Time the selector's forward table at batch sizes up to ``up_to`` (default: what it
        covers already). ``fresh``: every shape again, and the arms' corrections start over;
        otherwise only shapes not yet timed (a table extended to larger batches keeps the rest)."""
        start = time.perf_counter()
        selector = self.ensure_selector()
        up_to = max(up_to or 0, self.covered_batch, 1)
        known = None if fresh or selector.costs is None else selector.costs.table
        table = self._calibrate(selector.config, selector.arms, up_to, known, fresh)
        if known is None:
            selector.use_costs(StepCosts(table))
        else:
            selector.costs.table = table
        if self._timed_drafter is not None and any(a.uses_model_drafter for a in selector.arms):
            timed = {n for n, _ in known.measured} if known is not None else set()
            sizes = sorted({n for n, _ in table.measured} - timed)
            repeats = selector.config.calibration_repeats
            selector.costs.seed_drafting({n: self._timed_drafter.draft_level_seconds(n, repeats) for n in sizes})
        self.covered_batch = up_to
        self.stats.calibration_time_s += time.perf_counter() - start

    def expect(self, batch: int) -> None:
        """The next rollouts reach about ``batch`` sequences at once, though fewer may start them
        (a Ray worker's session: its requests arrive in chunks): calibration covers that batch
        from the first of them, not from the second on."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"expected batch must be an int >= 1, got {batch!r}")
        self.expected_batch = batch

    def _reach(self, requests: int) -> int:
        """The batch a calibration before a rollout of ``requests`` covers."""
        reach = max(requests, self.largest_batch, self.expected_batch)
        return calibrated_batch(reach, self.config.max_num_seqs)

    def before_rollout(self, requests: int) -> None:
        """Nothing runs and ``requests`` wait to start: ``adaptive``'s step costs are calibrated
        up to the batch the rollout can reach (on first need, or beyond what was timed), or timed
        again once the arms drifted far off them. The batch it can reach is its requests, or the
        largest an earlier rollout reached (a server's or a Ray worker's batch grows inside a
        rollout as requests arrive: unless the caller said how large (:meth:`expect`), the first
        such rollout runs its larger batches on the table's extrapolation, the next ones on timings)."""
        if self.selector is None or not self.strategy.adaptive or not requests:
            return
        batch = self._reach(requests)
        if self.selector.costs is None:
            self.calibrate(batch, fresh=False)
        elif self.selector.needs_recalibration:
            logger.info(
                "adaptive: steps ran %.2fx off the calibrated costs; calibrating again", self.selector.costs.drift()
            )
            self.calibrate(batch)
        elif batch > self.covered_batch:
            logger.info("adaptive: calibrating batches up to %d (%d requests waiting)", batch, requests)
            self.calibrate(batch, fresh=False)

    def plan(self, num_active: int, tokens_to_go: int, lag_tokens: int = 0, context: float | None = None) -> StepPlan:
        """The strategy of a step of ``num_active`` sequences of mean ``context`` cached tokens
        expected to generate ``tokens_to_go`` more, whose model drafter missed ``lag_tokens`` of
        their tokens (:class:`DrafterLag`)."""
        strategy = self.strategy
        if strategy.adaptive:
            if self.selector.costs is None:  # switched to adaptive inside a rollout: calibrate now
                self.calibrate(self._reach(num_active), False)
            if self.has_model_drafter:
                self.selector.on_drafter_version(self._versioned.version if self._versioned is not None else 0)
            strategy = self.selector.choose(num_active, tokens_to_go, lag_tokens, context)
            return StepPlan(strategy, lag_tokens if strategy.uses_model_drafter else 0, context)
        return StepPlan(strategy)

    def record(self, plan: StepPlan, num_active: int, outcome: StepOutcome) -> None:
        """What a step of ``plan`` on ``num_active`` sequences did."""
        self.largest_batch = max(self.largest_batch, num_active)
        if self.selector is not None and self.strategy.adaptive:
            self.selector.observe(
                plan.strategy,
                num_active,
                outcome.seconds,
                outcome.draft_seconds,
                outcome.drafted,
                outcome.accepted,
                plan.lag_tokens,
                outcome.branches,
                timed=not outcome.one_off,
                forward_seconds=outcome.forward_seconds,
                context=plan.context,
            )

    def state_dict(self) -> dict[str, Any] | None:
        return self.selector.state_dict() if self.selector is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.ensure_selector().load_state_dict(state)
