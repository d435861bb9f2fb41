"""Which strategy each decode step runs: the configured one, or, for ``adaptive``, the selector's
pick from measured goodput (``rollout/selector.py``), with what each step teaches it.

The engine asks :meth:`StrategyChoice.plan` before a decode step and hands the step's outcome to
:meth:`StrategyChoice.record` after it; it never talks to the selector itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..draft_contract import Drafter, Versioned
from .params import RolloutConfig
from .selector import StrategySelector
from .stats import EngineStats
from .strategy import Strategy, parse_strategy

logger = logging.getLogger(__name__)
SWITCH_GAP = 4  # a model-drafter step after this many steps without the drafter is a switch (its catch-up)


@dataclass(frozen=True)
class StepPlan:
    """A decode step's strategy. ``probe``: only that many sequences draft (the selector's cheap
    first try of an arm on a large batch). ``reprobe``: a drafting arm tried again where plain
    decoding had won. ``switch``: the model drafter's first step after several without it (it
    pays the drafter's catch-up on their tokens, a cost of switching, not of the arm)."""

    strategy: Strategy
    probe: int | None = None
    reprobe: bool = False
    switch: bool = False


class StrategyChoice:
    """The configured strategy (:meth:`set`), and for ``adaptive`` the selector that picks an arm
    per step; the selector is made on first need and kept across calls and strategy changes
    (what it measured is the engine's learned state)."""

    def __init__(self, config: RolloutConfig, drafter: Drafter | None) -> None:
        self.config = config
        self.has_model_drafter = drafter is not None
        # a drafter trained online changes version: the selector then forgets (most of) what its arms measured
        self._versioned = drafter if isinstance(drafter, Versioned) else None
        self.strategy = Strategy("none")
        self.selector: StrategySelector | None = None
        self._model_drafter_gap = SWITCH_GAP  # decode steps since the model drafter last drafted
        self._full_draft_gap = SWITCH_GAP  # ... since it last drafted for every sequence (not a probe)

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

    def plan(self, num_active: int) -> StepPlan:
        strategy, probe, reprobe = self.strategy, None, False
        if strategy.adaptive:
            if self.has_model_drafter:
                self.selector.on_drafter_version(self._versioned.version if self._versioned is not None else 0)
            choice = self.selector.plan(num_active)
            strategy, probe, reprobe = choice.strategy, choice.drafting, choice.reprobe
        gap = self._model_drafter_gap if probe is not None else self._full_draft_gap
        return StepPlan(strategy, probe, reprobe, switch=strategy.uses_model_drafter and gap >= SWITCH_GAP)

    def record(
        self, plan: StepPlan, num_active: int, emitted: int, seconds: float, draft_s: float, stats: EngineStats
    ) -> None:
        """What a step of ``plan`` did: ``emitted`` tokens in ``seconds`` of steady step time (a
        graph capture's time taken out), ``draft_s`` of them drafting."""
        if self.selector is not None and self.strategy.adaptive:
            resumed = self.selector.observe(
                num_active, plan.strategy, emitted, seconds, plan.probe, draft_s, plan.switch
            )
            stats.reprobes += plan.reprobe
            if resumed:
                stats.reprobes_paying += 1
                logger.info(
                    "adaptive: drafting (%s) resumes on %d sequences, where plain decoding had won until a "
                    "periodic probe found it paying again",
                    plan.strategy,
                    num_active,
                )
        model_step = plan.strategy.uses_model_drafter
        self._model_drafter_gap = 0 if model_step else self._model_drafter_gap + 1
        # a probe drafts for a few sequences only: the others' drafter state still lags
        self._full_draft_gap = 0 if model_step and plan.probe is None else self._full_draft_gap + 1

    def state_dict(self) -> dict[str, Any] | None:
        return self.selector.state_dict() if self.selector is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.ensure_selector().load_state_dict(state)
