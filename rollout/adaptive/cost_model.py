"""Predicted seconds of a decode step of each arm, measured once instead of learned by trying arms.

A step of arm ``a`` on ``n`` sequences is the target's verification forward (``n`` sequences of
``1 + a``'s draft nodes each) plus the drafting. Step costs belong to the hardware and the shapes,
which RL does not move, so:

* the **forward** is timed once per shape at calibration and interpolated between measured batch
  sizes and token widths (``forward_table.py``);
* **drafting** is a drafter's forward per draft level, costed as ``ratio x`` the target's forward
  over the same rows (``model``: seeded by the drafter's level timed at calibration where it times
  one, learned from every step that drafts, pooled over its arms and kept per power-of-two batch
  bucket, since a drafter's host work grows with the batch faster than a GPU forward does:
  :class:`BatchRatio`); the suffix drafter's, ``ratio x`` a one-token forward per drafted node; a
  model drafter's **catch-up** on what other arms emitted, ``ratio x`` a forward over it;
* the **host's part** of a step (scheduling, sampling and reading tokens back, verification,
  committing, the drafting's glue outside the drafter's forwards: what calibration, which times
  forwards, never sees) is measured on every step as its time less its target forward and
  drafting, per arm and batch bucket (:class:`HostSeconds`); an arm that has not run yet is priced
  with what the arms of its kind (plain or speculative) measured, never as free;
* online, each arm has a **correction** of its verification forward (its measured time against
  the table) per batch bucket, and an arm of two drafters (``hybrid``) one of its drafting
  too (the single-drafter arms' drafting is what their ratios learn): the parts judged apart,
  so a change in the drafting's cost is learned once, by its ratio, never also by a correction
  taken against the old ratio. Every factor is a median of clipped log ratios, shrunk towards 1,
  robust to outliers, and reset by a run of measurements all off it on one side (a level shift:
  :func:`push`), so a rollout that drafts at another cost (sampled after greedy) is followed
  within it rather than once half the window has seen it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

from ..strategy import Strategy
from .forward_table import ForwardTable

SHIFT_RUN = 4  # this many measurements in a row ...
SHIFT = math.log(1.5)  # ... all this far off the older ones' median, on one side: the level moved


def push(logs: deque[float], value: float) -> float:
    """Append ``value`` to a window of logs whose median is a level. When the level moves (a
    sampled rollout after a greedy one drafts at twice the cost; another job shares the GPU), the
    last :data:`SHIFT_RUN` values all lie on one side of the older ones, beyond :data:`SHIFT`, and
    the older ones go: a median over the whole window would follow only once half of it was new.
    A lone outlier (a collection, a spike) never moves it. Returns how far the level moved (its
    log; 0: no shift)."""
    logs.append(value)
    if len(logs) > SHIFT_RUN:
        values = list(logs)
        older = statistics.median(values[:-SHIFT_RUN])
        recent = values[-SHIFT_RUN:]
        if all(v - older > SHIFT for v in recent) or all(older - v > SHIFT for v in recent):
            for _ in range(len(values) - SHIFT_RUN):
                logs.popleft()
            return statistics.median(recent) - older
    return 0.0


class Ratio:
    """A multiplicative factor from recent measured/predicted ratios: the median of their logs
    (each clipped to ``clip`` x either way, if given), shrunk towards ``prior`` as if it were
    ``weight`` more; ``shifts``: a run of measurements off the median resets it (:func:`push`)."""

    def __init__(
        self, prior: float, weight: float, window: int = 32, clip: float | None = None, shifts: bool = True
    ) -> None:
        self.prior, self.weight, self.shifts = prior, weight, shifts
        self.clip = math.log(clip) if clip is not None else math.inf
        self.logs: deque[float] = deque(maxlen=window)
        self._value: float | None = None  # until the next add or load: every adaptive step reads it

    def add(self, measured: float, predicted: float) -> float | None:
        """Adds the clipped log ratio and returns it (None: nothing to add)."""
        if measured <= 0 or predicted <= 0:
            return None
        value = max(-self.clip, min(self.clip, math.log(measured / predicted)))
        self._value = None
        if self.shifts:
            push(self.logs, value)
        else:
            self.logs.append(value)
        return value

    @property
    def value(self) -> float:
        if self._value is None:
            m = len(self.logs)
            log = statistics.median(self.logs) if m else 0.0
            self._value = (
                math.exp((m * log + self.weight * math.log(self.prior)) / (m + self.weight)) if m else self.prior
            )
        return self._value

    def state(self) -> list[float]:
        return [self.prior, *self.logs]

    def load(self, state: list[float]) -> None:
        self.prior = state[0]
        self.logs.clear()
        self.logs.extend(state[1:])
        self._value = None


def batch_bucket(n: int) -> int:
    """Batch sizes 1, 2-3, 4-7, ... share a bucket (its log2, rounded down)."""
    return max(n, 1).bit_length() - 1


class BatchRatio:
    """A :class:`Ratio` that depends on the batch size. Drafting does not scale as the target's
    forward does (on a GPU the drafter's per-sequence host work grows with the batch while the
    target's forward barely does), so the factor is kept per power-of-two batch bucket, each
    bucket's median shrunk towards the ratio pooled over all of them as if that were
    ``bucket_weight`` more steps; a bucket never measured reads its measured neighbours
    (interpolated in log n, the nearest one past either end), or the pooled ratio if none is. A
    level shift in one bucket (:func:`push`) moves every other bucket's logs by as much: what moves
    a drafting cost (sampling, another job on the device) moves it at every batch size, and a
    bucket otherwise learns it only from its own steps. (The pooled logs, a mix of the buckets,
    are left to follow: moving them too made the simulator's noisy regime mistake noise for
    shifts.)"""

    def __init__(
        self, prior: float, weight: float, bucket_weight: float = 1.0, window: int = 32, clip: float | None = None
    ) -> None:
        # the pooled logs mix buckets of other levels: a batch that shrinks is no shift
        self.pooled = Ratio(prior, weight, window, clip, shifts=False)
        self.bucket_weight, self.window = bucket_weight, window
        self.buckets: dict[int, deque[float]] = {}
        self._values: dict[int, float] = {}  # per batch size, until the next add or load

    def add(self, n: int, measured: float, predicted: float) -> None:
        value = self.pooled.add(measured, predicted)
        if value is not None:
            self._values.clear()
            bucket = batch_bucket(n)
            moved = push(self.buckets.setdefault(bucket, deque(maxlen=self.window)), value)
            if moved:  # the level moved everywhere: the other buckets' logs move with it
                for other, logs in self.buckets.items():
                    if other != bucket:
                        self.buckets[other] = deque((v + moved for v in logs), maxlen=self.window)

    def _log_of(self, bucket: int, pooled: float) -> float:
        logs = self.buckets[bucket]
        return (len(logs) * statistics.median(logs) + self.bucket_weight * pooled) / (len(logs) + self.bucket_weight)

    def value(self, n: int) -> float:
        value = self._values.get(n)
        if value is None:
            value = self._values[n] = self._value(n)
        return value

    def _value(self, n: int) -> float:
        if not self.buckets:
            return self.pooled.value
        pooled = math.log(self.pooled.value)
        if batch_bucket(n) in self.buckets:
            return math.exp(self._log_of(batch_bucket(n), pooled))
        x = math.log2(max(n, 1))
        below = [b for b in sorted(self.buckets) if b < x]
        above = [b for b in sorted(self.buckets) if b > x]
        if not below or not above:  # past either end: the nearest measured bucket
            return math.exp(self._log_of(below[-1] if below else above[0], pooled))
        b0, b1 = below[-1], above[0]
        y0, y1 = self._log_of(b0, pooled), self._log_of(b1, pooled)
        return math.exp(y0 + (y1 - y0) * (x - b0) / (b1 - b0))

    def state(self) -> dict:
        return {"pooled": self.pooled.state(), "buckets": {str(b): list(v) for b, v in self.buckets.items()}}

    def load(self, state: dict) -> None:
        self.pooled.load(state["pooled"])
        self.buckets = {int(b): deque(v, maxlen=self.window) for b, v in state["buckets"].items()}
        self._values.clear()


class HostSeconds:
    """The host's seconds in a step, per arm and batch bucket: the median of the arm's recent
    measurements in the bucket, shrunk towards its kind's (the plain arm, or every speculative
    arm) as if that were ``kind_weight`` more steps (in logs, level shifts followed as by
    :func:`push`). A bucket the arm has not measured reads its kind's there, else the nearest
    measured bucket (the arm's, its kind's, the other kind's) scaled by the batch size: the host's
    work grows with the rows it handles. Nothing measured at all: 0."""

    FLOOR = 1e-6  # seconds: a step's host part is never priced below this (its log stays finite)

    def __init__(self, window: int = 32, kind_weight: float = 4.0) -> None:
        self.window, self.kind_weight = window, kind_weight
        self.by_arm: dict[tuple[str, int], deque[float]] = {}  # (arm, bucket) -> log seconds
        self.by_kind: dict[tuple[bool, int], deque[float]] = {}  # (speculative, bucket) -> log seconds

    def add(self, arm: Strategy, n: int, seconds: float) -> None:
        bucket, value = batch_bucket(n), math.log(max(seconds, self.FLOOR))
        push(self.by_arm.setdefault((str(arm), bucket), deque(maxlen=self.window)), value)
        push(self.by_kind.setdefault((arm.speculative, bucket), deque(maxlen=self.window)), value)

    def value(self, arm: Strategy, n: int) -> float:
        bucket = batch_bucket(n)
        own, kind = self.by_arm.get((str(arm), bucket)), self.by_kind.get((arm.speculative, bucket))
        if own and kind:
            m = len(own)
            log = (m * statistics.median(own) + self.kind_weight * statistics.median(kind)) / (m + self.kind_weight)
            return math.exp(log)
        if own or kind:
            return math.exp(statistics.median(own or kind))
        return self._nearest(arm, n)

    def _nearest(self, arm: Strategy, n: int) -> float:
        stores = ((self.by_arm, str(arm)), (self.by_kind, arm.speculative), (self.by_kind, not arm.speculative))
        for store, key in stores:
            buckets = [b for (k, b), logs in store.items() if k == key and logs]
            if buckets:
                near = min(buckets, key=lambda b: abs(b - batch_bucket(n)))
                return math.exp(statistics.median(store[(key, near)])) * max(n, 1) / (1 << near)
        return 0.0

    def state(self) -> dict:
        by_arm, by_kind = self.by_arm.items(), self.by_kind.items()
        return {
            "by_arm": [[a, b, list(v)] for (a, b), v in by_arm],
            "by_kind": [[k, b, list(v)] for (k, b), v in by_kind],
        }

    def load(self, state: dict) -> None:
        self.by_arm = {(a, b): deque(v, maxlen=self.window) for a, b, v in state["by_arm"]}
        self.by_kind = {(bool(k), b): deque(v, maxlen=self.window) for k, b, v in state["by_kind"]}


def _correction_in(corrections: dict[Strategy, BatchRatio], arm: Strategy) -> BatchRatio:
    """``arm``'s correction in ``corrections``, made at 1.0 if it has none yet: measured / predicted
    seconds, per batch bucket, shrunk towards 1 and robust to outliers."""
    if arm not in corrections:
        corrections[arm] = BatchRatio(1.0, 8.0, bucket_weight=8.0, clip=3.0)
    return corrections[arm]


class StepCosts:
    """Each arm's whole step: the forward with its correction, the drafting, the host's part."""

    def __init__(self, table: ForwardTable) -> None:
        self.table = table
        # priors until the first measurement (or seed_drafting): a drafter level a tenth of the target's
        # forward, a suffix node a hundredth of a one-token step, a catch-up token a fifth of a row
        self.draft = {"model": BatchRatio(0.1, 0.5), "suffix": BatchRatio(0.01, 0.5)}
        self.catch_up = Ratio(0.2, 0.5)
        self.correction: dict[Strategy, BatchRatio] = {}  # per arm: its verification forward
        self.draft_correction: dict[Strategy, BatchRatio] = {}  # per arm of two drafters: its drafting
        self._warm: set[tuple[Strategy, int]] = set()  # (arm, batch bucket) pairs past their first step
        self.host = HostSeconds()

    def _model_unit(self, arm: Strategy, n: int) -> float:
        """The target's seconds for one of ``arm``'s draft levels over ``n`` sequences."""
        shape = arm.shape
        width = math.ceil(shape.max_nodes / shape.depth)
        return shape.depth * self.table.seconds(n * width, 1)

    def _suffix_unit(self, arm: Strategy, n: int) -> float:
        return n * arm.shape.max_nodes * self.table.seconds(1, 1)

    def verify_seconds(self, arm: Strategy, n: int, context: float | None = None) -> float:
        """Uncorrected: the verification forward (the calibrated table) at a mean ``context``."""
        return self.table.seconds(n, 1 + arm.max_draft_nodes, context)

    def draft_seconds(self, arm: Strategy, n: int) -> float:
        """Uncorrected: the drafting, from the drafters' learned ratios."""
        seconds = 0.0
        if arm.uses_model_drafter:
            seconds += self.draft["model"].value(n) * self._model_unit(arm, n)
        if "suffix" in arm.drafters:
            seconds += self.draft["suffix"].value(n) * self._suffix_unit(arm, n)
        return seconds

    def seconds(self, arm: Strategy, n: int, context: float | None = None) -> float:
        """A step of ``arm`` on ``n`` sequences of mean ``context`` cached tokens (None: calibration's)."""
        draft = self.draft_seconds(arm, n)
        if arm in self.draft_correction:
            draft *= self.draft_correction[arm].value(n)
        verify = self.verify_seconds(arm, n, context) * _correction_in(self.correction, arm).value(n)
        return verify + draft + self.host.value(arm, n)

    def seed_drafting(self, levels: dict[int, float | None]) -> None:
        """``levels[n]``: seconds of a model drafter's level over ``n`` sequences, timed at calibration
        (None: not timed); one measurement of its ratio at each ``n``, which its arms' steps then outweigh."""
        for n, seconds in levels.items():
            if seconds is not None:
                self.draft["model"].add(n, seconds, self.table.seconds(n, 1))

    def observations(self, arm: Strategy) -> int:
        """How many steady steps ``arm``'s correction has learned from (its window's)."""
        correction = self.correction.get(arm)
        return len(correction.pooled.logs) if correction is not None else 0

    def catch_up_seconds(self, lag_tokens: int) -> float:
        """A model drafter's catch-up on ``lag_tokens`` tokens it did not see (0: none)."""
        return self.catch_up.value * self.table.seconds(lag_tokens, 1) if lag_tokens else 0.0

    def observe(
        self,
        arm: Strategy,
        n: int,
        seconds: float,
        draft_seconds: float,
        lag_tokens: int,
        forward_seconds: float | None = None,
        context: float | None = None,
    ) -> float | None:
        """A step of ``arm`` on ``n`` sequences took ``seconds``, ``draft_seconds`` of them drafting
        and ``forward_seconds`` in the target's forward (None: not measured apart; the host's part
        then stays in the correction), after ``lag_tokens`` tokens its model drafter had to catch
        up on; ``context``: its sequences' mean cached tokens (None: calibration's). What is left is
        the host's part, learned for every step of the arm. An arm's first step at a batch bucket
        teaches nothing: it pays a shape's first use (a kernel's compilation, the allocator's
        growth), which read as the arm's cost would keep it from running there again.

        The step's two parts are judged apart: the verification against the table (the arm's
        correction), the drafting by the ratio it teaches (a drafter alone) or, for an arm of two
        drafters, by a drafting correction of its own: one correction of the whole step would count
        a drafting ratio's change twice (its logs, taken against the old ratio, still say "slower")

        Returns how far the step's prediction was off (|log(measured / predicted)|, made before
        this step taught anything), or None for a step that teaches no costs of the arm's own."""
        if (arm, batch_bucket(n)) not in self._warm:
            self._warm.add((arm, batch_bucket(n)))
            return None
        error = abs(math.log(seconds / max(self.seconds(arm, n, context), 1e-9))) if seconds > 0 else None
        forward = seconds - draft_seconds if forward_seconds is None else forward_seconds
        if forward_seconds is not None:
            self.host.add(arm, n, seconds - draft_seconds - forward)
        pure = arm.kind in ("chain", "tree")  # drafting by the model drafter alone, serially
        if lag_tokens and arm.uses_model_drafter:
            if pure:
                catch_up = draft_seconds - self.draft["model"].value(n) * self._model_unit(arm, n)
                self.catch_up.add(catch_up, self.table.seconds(lag_tokens, 1))
            return None  # a switch: the arm's own costs are judged on steady steps
        if pure:
            self.draft["model"].add(n, draft_seconds, self._model_unit(arm, n))
        elif arm.kind == "suffix":
            self.draft["suffix"].add(n, draft_seconds, self._suffix_unit(arm, n))
        elif arm.speculative:
            _correction_in(self.draft_correction, arm).add(n, draft_seconds, self.draft_seconds(arm, n))
        _correction_in(self.correction, arm).add(n, forward, self.verify_seconds(arm, n, context))
        return error

    def drift(self) -> float:
        """How far, as a factor >= 1, the median arm's correction is from 1 (the table is stale when
        every arm runs slower or faster than it says: another load on the machine, a clock change)."""
        values = [r.pooled.value for r in self.correction.values() if r.pooled.logs]
        if not values:
            return 1.0
        middle = statistics.median(values)
        return max(middle, 1 / middle)

    def state_dict(self) -> dict:
        return {
            "draft": {k: r.state() for k, r in self.draft.items()},
            "catch_up": self.catch_up.state(),
            "correction": {str(a): r.state() for a, r in self.correction.items()},
            "draft_correction": {str(a): r.state() for a, r in self.draft_correction.items()},
            "host": self.host.state(),
        }

    def load_state_dict(self, state: dict, arms: Iterable[Strategy]) -> None:
        for key, saved in state["draft"].items():
            self.draft[key].load(saved)
        self.catch_up.load(state["catch_up"])
        for arm in arms:
            if str(arm) in state["correction"]:
                _correction_in(self.correction, arm).load(state["correction"][str(arm)])
            if str(arm) in state.get("draft_correction", {}):
                _correction_in(self.draft_correction, arm).load(state["draft_correction"][str(arm)])
        if "host" in state:
            self.host.load(state["host"])
