"""Per-step choice of the speculation strategy (``adaptive``), analytic rather than explored.

For a step of ``n`` sequences with ``remaining`` tokens still to generate, every arm ``a`` is
predicted to finish that work in

    catch_up(a) + remaining * seconds(a, n) / (n * expected(a))

where ``seconds`` is the whole step's cost (``rollout/adaptive/cost_model.py``: the verification
forward timed once per shape at calibration, the drafting as a ratio of it, corrections per arm and
batch bucket, and the host's part measured on every step), ``expected`` the tokens a
sequence-step emits (``rollout/adaptive/acceptance.py``: pooled per drafter from every verified
step), and ``catch_up`` what a model drafter pays for the tokens it missed while other arms ran: a
switch to a model arm happens only when its gain over the remaining work beats that. The arm with
the least predicted time runs, except that the last step's arm keeps running unless another is
predicted faster by more than the model can resolve (:meth:`StrategySelector.margin`): a standard
error of the two predictions' difference, from the model's own error (the median of how far its
recent step predictions were off) and the steps each arm's cost was learned from (an arm no step
has measured is tried as soon as its optimistic prediction wins). The arms'
predictions often lie within a few percent of each other: a switch on a difference the model
cannot resolve costs steps of the worse arm, and a margin wider than what it can resolve keeps a
worse arm running. Uncertainty is
handled on acceptance only, the costs being
measured: an arm's expected tokens are moved towards its best case as if that were ``optimism``
more sequence-steps of evidence, so an arm never drafted is tried once where it could win; one step
of any chain arm teaches every depth of its drafter, and a tree starts from its drafter's chain.
There is no exploration schedule and no probe: an arm is tried only where its best case could win.

A new model-drafter version weighs what its arms measured by ``version_weight`` (acceptance only;
costs are the architecture's). Workers' acceptance books merge at each policy sync
(:meth:`StrategySelector.merge_acceptance`). ``state_dict`` keeps what was learned across runs.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from ...config_tree import require
from ..params import SelectorConfig
from ..strategy import Strategy, parse_strategy
from .acceptance import AcceptanceBook, book_key
from .cost_model import StepCosts

logger = logging.getLogger(__name__)

ERROR_WINDOW = 32  # steady steps whose prediction errors make the model's error
ERROR_MIN_STEPS = 8  # before this many, no margin: the arms are still being measured
# the standard error of the median of m logs, over (their median absolute deviation / sqrt(m)),
# for normal noise: 1.2533 * 1.4826
MEDIAN_SE = 1.858

STATE_VERSION = 6  # 6: the host's part of a step; 5: corrections per batch bucket


@dataclass(frozen=True)
class Prediction:
    """One arm's prediction for a step: its seconds, tokens per sequence-step (optimistic and
    not), and the predicted time for the remaining work it is ranked by."""

    arm: Strategy
    seconds: float
    expected: float
    hopeful: float
    catch_up: float
    finish_s: float


class StrategySelector:
    """Chooses an arm per decode step from :class:`StepCosts` and an :class:`AcceptanceBook`."""

    def __init__(self, config: SelectorConfig | None = None, *, has_model_drafter: bool = True) -> None:
        self.config = config or SelectorConfig()
        arms = [parse_strategy(a) for a in self.config.arms]
        self.arms = [a for a in arms if has_model_drafter or not a.uses_model_drafter]
        self.dropped_arms = [a for a in arms if a not in self.arms]
        require(bool(self.arms), "arms", "at least one arm that needs no model drafter (no drafter given)", arms)
        self.costs: StepCosts | None = None  # set by calibration
        self.acceptance = AcceptanceBook()
        self.drafter_version: int | None = None
        self._model_keys = {book_key(a) for a in self.arms if a.uses_model_drafter}
        self._saved_costs: dict | None = None  # a loaded state's costs, until calibration
        self.last_arm: Strategy | None = None  # the arm of the last step observed
        # |log(measured / predicted)| of recent steady steps: how far the cost model is off
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)

    def predictions(
        self,
        n: int,
        remaining: int,
        lag_tokens: int = 0,
        optimism: float | None = None,
        context: float | None = None,
    ) -> list[Prediction]:
        """Every arm's prediction for a step of ``n`` sequences of mean ``context`` cached tokens
        (None: calibration's) with ``remaining`` tokens to go, best first; the model drafter missed
        ``lag_tokens`` tokens since it last drafted. ``optimism``: the configured one unless given
        (0: the point estimates)."""
        optimism = self.config.optimism if optimism is None else optimism
        if self.costs is None:
            raise RuntimeError("the selector has no step costs yet: calibrate it first (StrategySelector.costs)")
        out = []
        for arm in self.arms:
            seconds = self.costs.seconds(arm, n, context)
            expected = self.acceptance.expected(arm)
            hopeful = self.acceptance.expected(arm, optimism)
            catch_up = self.costs.catch_up_seconds(lag_tokens) if arm.uses_model_drafter else 0.0
            finish = catch_up + max(remaining, n) * seconds / (n * hopeful)
            out.append(Prediction(arm, seconds, expected, hopeful, catch_up, finish))
        return sorted(out, key=lambda p: p.finish_s)

    @property
    def error(self) -> float:
        """The cost model's measured error: the median |log(measured / predicted)| of a step's
        seconds over recent steady steps (0 until :data:`ERROR_MIN_STEPS` were measured)."""
        return statistics.median(self.errors) if len(self.errors) >= ERROR_MIN_STEPS else 0.0

    def choose(
        self, n: int, remaining: int | None = None, lag_tokens: int = 0, context: float | None = None
    ) -> Strategy:
        """The arm predicted to finish the remaining work soonest (``remaining`` unknown: one
        step's), unless the last step's arm is within the model's error of it (:attr:`error`)."""
        ranked = self.predictions(n, remaining if remaining is not None else n, lag_tokens, context=context)
        best = ranked[0]
        current = next((p for p in ranked if p.arm == self.last_arm), None)
        if current is not None and current.finish_s <= best.finish_s * math.exp(self.margin(current.arm, best.arm)):
            return current.arm
        return best.arm

    def margin(self, a: Strategy, b: Strategy) -> float:
        """The log gap by which ``b``'s prediction must beat ``a``'s before the selector leaves ``a``:
        ``switch_margin`` standard errors of their difference. Each arm's cost is the median of the
        steps its correction learned from, so its standard error is the model's per-step error
        (:attr:`error`) over the square root of their number. An arm no steady step has measured
        yet gets none: only running it measures it, and ``optimism`` already decides whether its
        best case is worth a try."""
        counts = [self.costs.observations(arm) for arm in (a, b)]
        if a == b or not self.error or not all(counts):
            return 0.0
        return self.config.switch_margin * MEDIAN_SE * self.error * math.sqrt(1 / counts[0] + 1 / counts[1])

    def observe(
        self,
        arm: Strategy,
        n: int,
        seconds: float,
        draft_seconds: float = 0.0,
        drafted: list[int] | None = None,
        accepted: list[int] | None = None,
        lag_tokens: int = 0,
        branches: list[tuple[int, int]] | None = None,
        timed: bool = True,
        forward_seconds: float | None = None,
        context: float | None = None,
    ) -> None:
        """A step of ``arm`` on ``n`` sequences took ``seconds`` (``draft_seconds`` drafting, after
        ``lag_tokens`` tokens of catch-up); per sequence, ``drafted`` draft tokens were verified
        and ``accepted`` kept, and its tree's first branch went ``branches`` (depth, kept) deep.
        ``timed`` False: its times are not the arm's (it paid a one-time cost: a graph capture, a
        model drafter's first look at a prompt), only its acceptance counts. ``forward_seconds``:
        the target forward's share (None: all but the drafting); ``context``: the sequences' mean
        cached tokens (None: calibration's)."""
        if arm not in self.arms or seconds <= 0 or n < 1:
            return
        self.last_arm = arm
        if self.costs is not None and timed:
            error = self.costs.observe(arm, n, seconds, draft_seconds, lag_tokens, forward_seconds, context)
            if error is not None:
                self.errors.append(error)
        if arm.speculative and drafted is not None:
            self.acceptance.observe(arm, drafted, accepted, branches)

    def on_drafter_version(self, version: int) -> None:
        """The model drafter changed weights: what its arms measured counts ``version_weight`` x."""
        if self.drafter_version is not None and version != self.drafter_version:
            self.acceptance.fade(self._model_keys, self.config.version_weight)
        self.drafter_version = version

    def merge_acceptance(self, merged: dict) -> None:
        """Adopt the book merged from every worker's (``AcceptanceBook.merged``) at a policy sync."""
        self.acceptance.load_state_dict(merged)

    @property
    def needs_recalibration(self) -> bool:
        return self.costs is None or self.costs.drift() >= self.config.recalibrate_at

    def state_dict(self) -> dict[str, Any]:
        """What it learned (JSON-serializable): acceptance, drafting ratios and corrections. The
        forward table is the hardware's and is measured again by the engine that loads it."""
        return {
            "version": STATE_VERSION,
            "arms": [str(a) for a in self.arms],
            "drafter_version": self.drafter_version,
            "acceptance": self.acceptance.state_dict(),
            # before its first calibration, a loaded state's costs (they apply at calibration)
            "costs": self.costs.state_dict() if self.costs is not None else self._saved_costs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. A state of other arms is an error; one saved by an earlier
        release (the exploring selector) is ignored with a warning."""
        if state["arms"] != [str(a) for a in self.arms]:
            raise ValueError("selector state was saved with other arms")
        if state.get("version") != STATE_VERSION:
            logger.warning("selector state of an earlier release (no version %d): starting from scratch", STATE_VERSION)
            return
        self.drafter_version = state["drafter_version"]
        self.acceptance.load_state_dict(state["acceptance"])
        self._saved_costs = state["costs"]
        if self.costs is not None and state["costs"] is not None:
            self.costs.load_state_dict(state["costs"], self.arms)

    def use_costs(self, costs: StepCosts) -> None:
        """Calibrated step costs (a new calibration keeps what was learned of the drafting ratios)."""
        previous = self.costs.state_dict() if self.costs is not None else self._saved_costs
        self.costs = costs
        if previous is not None:
            previous = {**previous, "correction": {}, "draft_correction": {}}  # the new table starts uncorrected
            costs.load_state_dict(previous, self.arms)
