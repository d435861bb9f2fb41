"""Conformal takeover: is a drafted chunk's score unusually bad compared with calibration chunks?

Scores are "higher = worse" (mean negative log-likelihood of the chunk under the target). With
``n`` calibration scores and level ``alpha``, the split-conformal threshold is the
``ceil((n + 1)(1 - alpha))``-th smallest calibration score (the finite-sample (n+1) correction);
a chunk is taken over when its score is strictly above it. For a test score exchangeable with the
calibration scores, P(takeover) = floor((n + 1) alpha) / (n + 1) when scores have no ties: at
most alpha, and more than alpha - 1/(n+1). When ``(n + 1) alpha < 1`` the threshold is infinite
and nothing is ever taken over (too few calibration scores for that level).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    return float(alpha)


@dataclass(frozen=True)
class ConformalCalibration:
    """Sorted calibration scores (build with :meth:`from_scores`)."""

    scores: tuple[float, ...]

    @classmethod
    def from_scores(cls, scores: Iterable[float]) -> ConformalCalibration:
        values = [float(s) for s in scores]
        if not values:
            raise ValueError("the calibration set is empty; score at least one held-out chunk")
        bad = [s for s in values if not math.isfinite(s)]
        if bad:
            raise ValueError(f"calibration scores must be finite, got {bad[:3]}")
        return cls(tuple(sorted(values)))

    @property
    def n(self) -> int:
        return len(self.scores)

    def threshold(self, alpha: float) -> float:
        """The ``ceil((n + 1)(1 - alpha))``-th smallest score; ``inf`` when that rank exceeds n."""
        alpha = _check_alpha(alpha)
        rank = math.ceil((self.n + 1) * (1 - alpha) - 1e-12)
        return math.inf if rank > self.n else self.scores[rank - 1]

    def p_value(self, score: float) -> float:
        """(1 + #{calibration scores >= score}) / (n + 1): small when ``score`` is unusually high."""
        at_least = self.n - bisect.bisect_left(self.scores, score)
        return (1 + at_least) / (self.n + 1)

    def guaranteed_rate(self, alpha: float) -> float:
        """The exact takeover probability for an exchangeable, tie-free score: floor((n+1) alpha)/(n+1)."""
        return math.floor((self.n + 1) * _check_alpha(alpha) + 1e-12) / (self.n + 1)


@dataclass(frozen=True)
class Decision:
    takeover: bool
    threshold: float
    level: float  # the alpha the decision used (moves in the online variant)


class TakeoverPolicy(Protocol):
    def decide(self, score: float) -> Decision: ...


@dataclass
class SplitConformal:
    """Take over when the score exceeds the fixed split-conformal threshold at ``alpha``."""

    calibration: ConformalCalibration
    alpha: float

    def __post_init__(self) -> None:
        self.alpha = _check_alpha(self.alpha)
        self._threshold = self.calibration.threshold(self.alpha)
        if math.isinf(self._threshold):
            logger.warning(
                "alpha = %g with %d calibration scores: (n+1)*alpha < 1, so no chunk will ever be taken over; "
                "use at least %d calibration scores",
                self.alpha,
                self.calibration.n,
                math.ceil(1 / self.alpha) - 1,
            )

    def decide(self, score: float) -> Decision:
        return Decision(score > self._threshold, self._threshold, self.alpha)


@dataclass
class OnlineConformal:
    """Adaptive conformal inference (Gibbs & Candès, 2021) over a fixed calibration set.

    After each decision the level moves by ``step * (alpha - takeover)``, so over T decisions the
    realized takeover rate is within ``(max(level) - min(level) + step) / (step * T)`` of alpha
    whatever the scores do; decisions are not individually guaranteed.
    """

    calibration: ConformalCalibration
    alpha: float
    step: float = 0.01
    level: float = field(init=False)

    def __post_init__(self) -> None:
        self.alpha = _check_alpha(self.alpha)
        if not 0 < self.step < 1:
            raise ValueError(f"step must be in (0, 1), got {self.step!r}")
        self.level = self.alpha

    def decide(self, score: float) -> Decision:
        if self.level <= 0:
            threshold = math.inf
        elif self.level >= 1:
            threshold = -math.inf
        else:
            threshold = self.calibration.threshold(self.level)
        decision = Decision(score > threshold, threshold, self.level)
        self.level += self.step * (self.alpha - float(decision.takeover))
        return decision


class NeverTakeover:
    """Accept every chunk: how calibration runs score draft chunks through the test-time path."""

    def decide(self, score: float) -> Decision:
        return Decision(False, math.inf, 0.0)


def make_policy(calibration: ConformalCalibration, alpha: float, mode: str = "split", step: float = 0.01):
    if mode == "split":
        return SplitConformal(calibration, alpha)
    if mode == "online":
        return OnlineConformal(calibration, alpha, step)
    raise ValueError(f"mode must be 'split' or 'online', got {mode!r}")


def _log_binom_pmf(k: int, n: int, p: float) -> float:
    if p <= 0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1:
        return 0.0 if k == n else -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)


def binomial_interval(trials: int, p: float, level: float = 0.99) -> tuple[int, int]:
    """The central ``level`` interval [lo, hi] of Binomial(trials, p), in counts (exact pmf sums)."""
    if trials < 0 or not 0 <= p <= 1 or not 0 < level < 1:
        raise ValueError(f"need trials >= 0, p in [0, 1], level in (0, 1); got {trials}, {p}, {level}")
    tail = (1 - level) / 2
    pmf = [math.exp(_log_binom_pmf(k, trials, p)) for k in range(trials + 1)]
    lo, acc = 0, 0.0
    while lo < trials and acc + pmf[lo] <= tail:
        acc += pmf[lo]
        lo += 1
    hi, acc = trials, 0.0
    while hi > 0 and acc + pmf[hi] <= tail:
        acc += pmf[hi]
        hi -= 1
    return lo, hi
