"""Per-batch choice of the speculation strategy from a measured goodput model.

A step of arm ``a`` (a strategy) on ``n`` sequences emits ``n * accept(a)`` tokens in
``seconds(a, n)``. The two factors behave differently, so they are learned apart:

* **Acceptance** (tokens emitted per drafting sequence-step) belongs to the arm, the drafter and the
  text, not to the batch size: every step of the arm, in any bucket, adds its drafting sequences'
  tokens to one pooled estimate. One probe on 8 sequences of a large batch therefore tells the
  small batches of the tail what the arm accepts. A bucket's own tokens refine the pooled value
  once they outweigh ``min_sequence_steps`` sequence-steps of it (shrinkage toward the pool), so
  an arm whose acceptance does differ by batch size is still judged by its own numbers there.
* **Speed** (sequence-steps per second) belongs to the arm *and* the batch size: its step time
  is a line in the batch size (``step_seconds``), fitted per arm through its full steps in every
  bucket (``bucket_bounds``: a bucket holds batch sizes up to its bound), weighted toward the
  batch size asked about, so it is carried to a bucket where the arm has not run yet.

The predicted goodput is their product. ``plan`` first gives every arm ``min_sequence_steps``
drafting sequence-steps of evidence (pooled, so on a large batch one step suffices), then
exploits by UCB over the arms with full steps in the bucket (predicted goodput plus a bonus that
shrinks with their drafting sequence-steps there, scaled by the bucket's best prediction) or
epsilon-greedy. A bucket seen for the first time needs no exploration of its own: it starts from
the carried predictions, and an arm gets a full step there only if its prediction comes within
``prune_ratio`` of the best measured there (or its time is carried from two or more buckets up).
Speculation therefore turns itself off wherever it is predicted or measured to be slower than
plain decoding, after one RL step, not ten. A configured ``speculate_up_to`` acts only as a prior
(above it, speculative arms are not explored until a smaller batch measured them).

Exploring costs most where the batch is large, and a rollout starts there. So:

* An arm's first try on a large batch (``probe_from`` sequences or more, plain decoding's speed
  known there) is a *probe*: only ``probe_sequences`` of the batch draft, the others take their
  plain token in the same forward; the acceptance is measured on the drafting sequences and the
  full step's time extrapolated (``observe``). An arm whose probe predicts a loss is never paid
  a full step; one predicted to win is run, and the full step replaces the extrapolation.
* An untried arm is skipped when a measurement already says it loses: in the same bucket, every
  *narrower* arm of its drafters (fewer draft nodes per sequence) predicted below
  ``width_prune_ratio`` of the best (a wider draft adds verification rows for tokens accepted
  ever less often), or the same arm on a smaller batch below ``prune_ratio`` of the best there
  (speculation returns less the more sequences share a step). Narrow arms are explored first.

Where plain decoding wins a bucket, the best drafting arm is probed again every ``reprobe_every``
plain steps there (a ``Choice`` marked ``reprobe``): a drafter that fell behind the policy and
caught up is found again; ``observe`` says when drafting resumes there in full, which the engine
counts (``EngineStats.reprobes_paying``) and drafter health reports.

A model-drafter arm's first step after steps of other arms also pays the drafter's catch-up on
their tokens (a *switch*): its time is set aside while the arm has a steady one in the bucket
(judged by its catch-ups, a model arm tried now and then on the demo's 56 sequences lost to plain
decoding there for good, while it runs 1.2x plain decoding once running).

When the model drafter's weights change (``on_drafter_version``), what its arms measured may no
longer hold. By default (``drafter_update="detect"``) their samples are kept and marked as the old
version's; once the new version has ``detect_evidence`` drafting sequence-steps of its own on an
arm, its acceptance there is compared with the old samples': off by more than ``drift_tolerance``
(relative), the old samples are dropped, else they stay and age out of the window as usual. A
version that moved the drafter little (a copy shipped past the held-out gate every few steps)
then costs no re-exploration, and one that moved it much is re-measured within a few steps. The
step times never go stale (the drafter's architecture is the same). ``"decay"`` keeps only the
newest ``decay_keep`` samples at once, ``"reset"`` none. State persists across ``generate`` calls
(RL steps) otherwise, and can be saved with ``state_dict``.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config_tree import ConfigError, require
from .strategy import Strategy, parse_strategy

logger = logging.getLogger(__name__)

POLICIES = ("ucb", "epsilon")
DEFAULT_ARMS = ("none", "chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid:4,2,12")
STATE_VERSION = 2


DRAFTER_UPDATES = ("detect", "decay", "reset")


@dataclass
class SelectorConfig:
    arms: tuple[str, ...] = DEFAULT_ARMS
    bucket_bounds: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
    policy: str = "ucb"
    ucb_c: float = 0.1  # exploration bonus, as a fraction of the bucket's best predicted goodput
    epsilon: float = 0.05
    window: int = 32  # rewards kept per (bucket, arm)
    min_trials: int = 1  # tries of every arm in a bucket before exploiting
    min_sequence_steps: int = 8  # ... and at least this many sequence-steps (trials x batch size)
    speculate_up_to: int | None = None  # prior: above this many active sequences, try "none" first
    prune_ratio: float = 0.7  # skip exploring an arm a smaller batch measured below this x the bucket's best
    width_prune_ratio: float = 0.9  # ... or whose every narrower arm measured below this x the best here
    probe_sequences: int = 8  # a first try on a large batch drafts for this many sequences only (0: never)
    probe_from: int = 32  # ... on batches of at least this many
    # where plain decoding wins a bucket, the best drafting arm is probed again after this many plain
    # steps there (0: never): a drafter that caught up with the policy is found again
    reprobe_every: int = 256
    # what a new drafter version does to model-drafter arms: detect | decay | reset (see the module doc)
    drafter_update: str = "detect"
    decay_keep: int = 4
    detect_evidence: int = 32  # drafting sequence-steps of a new version before its acceptance is compared
    drift_tolerance: float = 0.1  # relative acceptance change that drops an arm's old-version samples
    seed: int = 0

    def __post_init__(self) -> None:
        self.arms = tuple(self.arms)
        self.bucket_bounds = tuple(self.bucket_bounds)
        require(bool(self.arms), "arms", "at least one strategy", self.arms)
        for arm in self.arms:
            try:
                adaptive = parse_strategy(arm).adaptive
            except ValueError as e:
                raise ConfigError("arms", f"holds {arm!r}, which is not valid: {e}") from None
            require(not adaptive, "arms", "strategies other than 'adaptive'", self.arms)
        bounds = list(self.bucket_bounds)
        require(
            bool(bounds) and all(isinstance(b, int) and b >= 1 for b in bounds) and bounds == sorted(set(bounds)),
            "bucket_bounds",
            "increasing ints >= 1",
            bounds,
        )
        checks = [
            ("policy", self.policy in POLICIES, f"one of {POLICIES}"),
            ("ucb_c", self.ucb_c >= 0, "a float >= 0"),
            ("epsilon", 0 <= self.epsilon <= 1, "a float in [0, 1]"),
            ("window", isinstance(self.window, int) and self.window >= 1, "an int >= 1"),
            ("min_trials", isinstance(self.min_trials, int) and self.min_trials >= 1, "an int >= 1"),
            (
                "min_sequence_steps",
                isinstance(self.min_sequence_steps, int) and self.min_sequence_steps >= 0,
                "an int >= 0",
            ),
            ("speculate_up_to", self.speculate_up_to is None or self.speculate_up_to >= 0, "None or an int >= 0"),
            ("drafter_update", self.drafter_update in DRAFTER_UPDATES, f"one of {DRAFTER_UPDATES}"),
            ("decay_keep", isinstance(self.decay_keep, int) and self.decay_keep >= 0, "an int >= 0"),
            ("detect_evidence", isinstance(self.detect_evidence, int) and self.detect_evidence >= 1, "an int >= 1"),
            ("drift_tolerance", 0 <= self.drift_tolerance, "a float >= 0"),
            ("prune_ratio", 0 <= self.prune_ratio <= 1, "a float in [0, 1]"),
            ("width_prune_ratio", 0 <= self.width_prune_ratio <= 1, "a float in [0, 1]"),
            ("probe_sequences", isinstance(self.probe_sequences, int) and self.probe_sequences >= 0, "an int >= 0"),
            ("probe_from", isinstance(self.probe_from, int) and self.probe_from >= 1, "an int >= 1"),
            ("reprobe_every", isinstance(self.reprobe_every, int) and self.reprobe_every >= 0, "an int >= 0"),
        ]
        for name, ok, allowed in checks:
            require(ok, name, allowed, getattr(self, name))


def robust_mean(xs: list[float], spread: float = 1.3) -> float:
    """The mean of the values within ``spread`` x of their median either way: a step slowed by a
    collection or another process (40% and more) leaves it, the usual few percent of noise stay
    and keep a mean's precision."""
    middle = statistics.median(xs)
    kept = [x for x in xs if middle / spread <= x <= middle * spread]
    return sum(kept) / len(kept) if kept else middle


def fit_line(points: list[tuple[float, float]], around: float):
    """Weighted least squares ``t = fixed + per_item * n`` through ``points`` (n, t), a point's
    weight falling with its distance from ``around`` in doublings; both terms kept >= 0. None
    unless two points have different n."""
    by_n: dict[float, list[float]] = {}
    for n, t in points:
        by_n.setdefault(n, []).append(t)
    if len(by_n) < 2:
        return None
    # one point per batch size (robust to a step slowed by something else), weighted by its count
    rows = [(n, robust_mean(ts), len(ts) / (1.0 + abs(math.log2(n / around))) ** 2) for n, ts in by_n.items()]
    total = sum(w for _, _, w in rows)
    mean_n = sum(w * n for n, _, w in rows) / total
    mean_t = sum(w * t for _, t, w in rows) / total
    spread = sum(w * (n - mean_n) ** 2 for n, _, w in rows)
    per_item = sum(w * (n - mean_n) * (t - mean_t) for n, t, w in rows) / spread
    fixed = mean_t - per_item * mean_n
    if per_item < 0:
        fixed, per_item = mean_t, 0.0
    elif fixed < 0:
        fixed = 0.0
        per_item = sum(w * n * t for n, t, w in rows) / sum(w * n * n for n, _, w in rows)
    return lambda n: fixed + per_item * n


@dataclass(frozen=True)
class Choice:
    """The selector's pick for one step: the arm, and how many of the batch draft in it (None: all;
    a number: a *probe*, the arm's first try on a large batch, paid on a few sequences only)."""

    strategy: Strategy
    drafting: int | None = None
    reprobe: bool = False  # a drafting arm tried again where plain decoding won (``reprobe_every``)


@dataclass(frozen=True)
class Sample:
    """One step of an arm: ``sequences`` in the step, of which ``drafting`` drafted and emitted
    ``tokens``, in ``seconds`` (a probe's: the full step's, extrapolated). ``switch``: a
    model-drafter arm's first step after other arms, which also paid the drafter's catch-up."""

    sequences: int
    drafting: int
    tokens: float
    seconds: float
    probe: bool = False
    switch: bool = False

    @property
    def speed(self) -> float:
        """Sequence-steps per second."""
        return self.sequences / self.seconds


@dataclass
class ArmStats:
    """One arm's samples in one bucket."""

    samples: deque[Sample] = field(default_factory=deque)
    trials: int = 0  # all-time, for reporting
    stale: int = 0  # the oldest samples that belong to an earlier drafter version ("detect")
    _timed: list[Sample] | None = field(default=None, repr=False)

    @property
    def timed(self) -> list[Sample]:
        """The samples its speed is judged by: steady full steps, else steady probes, else switches
        (a catch-up after many plain steps would otherwise condemn an arm that wins once it runs)."""
        if self._timed is None:
            self._timed = []
            for keep in (
                lambda x: not x.probe and not x.switch,
                lambda x: not x.switch,
                lambda x: not x.probe,
                lambda x: True,
            ):
                self._timed = [x for x in self.samples if keep(x)]
                if self._timed:
                    break
        return self._timed

    @property
    def speed(self) -> float | None:
        """The robust mean speed of its timed steps (a step's time on a shared CPU can be 40% off)."""
        timed = self.timed
        return robust_mean([x.speed for x in timed]) if timed else None

    @property
    def tokens(self) -> float:
        return sum(x.tokens for x in self.samples)

    @property
    def drafting(self) -> int:
        return sum(x.drafting for x in self.samples)

    @property
    def full(self) -> list[Sample]:
        """Its steps on the whole batch (not probes)."""
        return [x for x in self.samples if not x.probe]

    @property
    def switched_only(self) -> bool:
        return bool(self.samples) and all(x.switch for x in self.samples)

    @property
    def fresh(self) -> list[Sample]:
        """The samples of the current drafter version (all, unless a new version is being judged)."""
        return list(self.samples)[self.stale :]

    def add(self, sample: Sample) -> None:
        if len(self.samples) == self.samples.maxlen and self.stale:  # the oldest, a stale one, drops out
            self.stale -= 1
        self.samples.append(sample)
        self.trials += 1
        self._timed = None

    def replace(self, samples: list[Sample]) -> None:
        self.samples = deque(samples, maxlen=self.samples.maxlen)
        self.stale = 0
        self._timed = None

    def keep_newest(self, keep: int) -> None:
        self.replace(list(self.samples)[-keep:] if keep else [])


class StrategySelector:
    """Bandit over strategies per batch-size bucket. ``has_model_drafter`` drops the arms that need one."""

    def __init__(self, config: SelectorConfig | None = None, *, has_model_drafter: bool = True) -> None:
        self.config = config or SelectorConfig()
        arms = [parse_strategy(a) for a in self.config.arms]
        self.arms: list[Strategy] = [a for a in arms if has_model_drafter or not a.uses_model_drafter]
        self.dropped_arms: list[Strategy] = [a for a in arms if a not in self.arms]
        if not self.arms:
            raise ValueError("no selector arm can run without a model drafter; add 'none' or 'suffix' arms")
        self._none = next((a for a in self.arms if a.kind == "none"), None)
        # the order untried arms are explored in: plain decoding first (the reference the probes
        # extrapolate from), then the speculative arms, narrowest draft first
        speculative = sorted((a for a in self.arms if a is not self._none), key=lambda a: a.max_draft_nodes)
        self._explore_order = speculative if self._none is None else [self._none, *speculative]
        # per arm, the speculative arms it contains: a subset of its drafters, at most as many draft nodes
        self._narrower = {
            arm: [
                a
                for a in speculative
                if a is not arm and a.drafters <= arm.drafters and a.max_draft_nodes <= arm.max_draft_nodes
            ]
            for arm in self.arms
        }
        w = self.config.window
        self._stats: list[dict[Strategy, ArmStats]] = [
            {a: ArmStats(deque(maxlen=w)) for a in self.arms} for _ in self.config.bucket_bounds
        ]
        self._rng = random.Random(self.config.seed)
        self._memo: dict[tuple, Any] = {}  # the model's values, until the next sample
        self.drafter_version: int | None = None
        self._plain_run = [0] * len(self.config.bucket_bounds)  # plain steps per bucket since a drafting one
        self._reprobed = [False] * len(self.config.bucket_bounds)  # re-probed, not drafting in full since

    def bucket(self, num_active: int) -> int:
        """Index of the bucket holding ``num_active`` sequences (the last bucket holds all larger)."""
        return min(bisect_left(self.config.bucket_bounds, num_active), len(self.config.bucket_bounds) - 1)

    # -- the goodput model ------------------------------------------------------------------------

    def _memoized(self, key: tuple, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def evidence(self, arm: Strategy) -> int:
        """Drafting sequence-steps behind ``arm``'s pooled acceptance (all buckets)."""
        return self._memoized(("evidence", arm), lambda: sum(stats[arm].drafting for stats in self._stats))

    def acceptance(self, arm: Strategy, b: int | None = None) -> float | None:
        return self._memoized(("acceptance", arm, b), lambda: self._acceptance(arm, b))

    def _acceptance(self, arm: Strategy, b: int | None) -> float | None:
        """Tokens per drafting sequence-step: pooled over every bucket, or in bucket ``b`` the
        bucket's own tokens shrunk toward the pool by ``min_sequence_steps`` sequence-steps."""
        drafting = self.evidence(arm)
        if not drafting:
            return None
        if b is None:
            return sum(stats[arm].tokens for stats in self._stats) / drafting
        pooled = self.acceptance(arm)
        own, k = self._stats[b][arm], max(self.config.min_sequence_steps, 1)
        return (own.tokens + k * pooled) / (own.drafting + k)

    def step_seconds(self, arm: Strategy, n: float) -> float | None:
        """``arm``'s step time on ``n`` sequences, from its timed steps on every batch size: a line
        (a fixed cost plus a cost per sequence, which is what a forward, a draft and a verification
        are made of) fitted with more weight on batch sizes near ``n`` (step time is a line only
        piecewise: flat while a GPU is bandwidth-bound). From steps of one batch size only, their
        time scaled as plain decoding's fitted time scales. None if the arm never ran."""
        key = ("seconds", arm, float(n))
        if key not in self._memo:
            points = self._memoized(("points", arm), lambda: self._time_points(arm))
            line = fit_line(points, around=n)
            if line is None and points:
                plain = self.step_seconds(self._none, n) if self._none is not None and arm is not self._none else None
                n1, t1 = points[0][0], robust_mean([t for _, t in points])  # one batch size
                plain_n1 = self.step_seconds(self._none, n1) if plain is not None else None
                line = (lambda m: t1 * plain / plain_n1) if plain is not None and plain_n1 else (lambda m: t1)
            self._memo[key] = line(n) if line is not None else None
        return self._memo[key]

    def _time_points(self, arm: Strategy) -> list[tuple[int, float]]:
        """(batch size, step time) of ``arm``'s timed steps in every bucket; once it has a full step
        anywhere, full steps only: a probe's time is extrapolated from a few drafting sequences and
        scales the spec step's fixed costs with them (on the demo's 56 sequences in-process a
        ``chain:4`` probe stood for a 0.75 s step, its full steps cost 0.16 s)."""
        timed = [x for stats in self._stats for x in stats[arm].timed]
        full = [x for x in timed if not x.probe]
        return [(x.sequences, x.seconds) for x in full or timed]

    def speed(self, arm: Strategy, b: int, n: float | None = None) -> float | None:
        """Sequence-steps per second of ``arm`` on ``n`` sequences (bucket ``b``'s typical batch by
        default), from ``step_seconds``. None: unknown."""
        n = self._typical(b) if n is None else n
        seconds = self.step_seconds(arm, n)
        return n / seconds if seconds else None

    def _typical(self, b: int) -> float:
        """The batch size bucket ``b`` has run at (mean of its steps), else its bound."""

        def compute() -> float:
            sizes = [x.sequences for stats in self._stats[b].values() for x in stats.samples]
            return sum(sizes) / len(sizes) if sizes else float(self.config.bucket_bounds[b])

        return self._memoized(("typical", b), compute)

    def predicted(self, arm: Strategy, b: int, n: float | None = None) -> float | None:
        """Predicted goodput (tokens/s) of ``arm`` in bucket ``b`` (on ``n`` sequences where it did
        not run there); None where it cannot be told."""

        def compute() -> float | None:
            accept, speed = self.acceptance(arm, b), self.speed(arm, b, n)
            return None if accept is None or speed is None else accept * speed

        return self._memoized(("predicted", arm, b, n), compute)

    # -- choosing -------------------------------------------------------------------------------

    def _standing(self, b: int, arm: Strategy, judged: Strategy | None = None) -> float | None:
        """``arm``'s predicted goodput relative to the best of the arms run in bucket ``b`` (a
        measurement, not a carried prediction, is what rules an arm out), leaving out ``judged``,
        the arm whose fate the standing decides (it cannot rule itself out)."""
        mine = self.predicted(arm, b)
        ran = [
            p
            for a in self.arms
            if a is not judged and self._stats[b][a].samples and (p := self.predicted(a, b)) is not None
        ]
        return None if mine is None or not ran else mine / max(ran)

    def _neighbour_standing(self, b: int, arm: Strategy) -> float | None:
        """``arm``'s standing in the nearest *smaller-batch* bucket that ran it. Only smaller
        batches count: an arm that loses on fewer sequences will lose on more, but one that
        loses on a large batch may well win in the tail."""
        for nb in range(b - 1, -1, -1):
            if self._stats[nb][arm].samples:
                return self._standing(nb, arm)
        return None

    def _far_below(self, b: int, arm: Strategy) -> bool:
        """Whether ``arm`` ran on no batch smaller than bucket ``b``'s and on none in the next
        larger bucket: its speed here is then carried from two or more buckets up, a loose lower
        bound (speculation returns more the fewer sequences share a step), so one step here is
        worth paying to measure it."""
        ran = [nb for nb, stats in enumerate(self._stats) if stats[arm].samples]
        return bool(ran) and min(ran) >= b + 2

    def _narrower_standing(self, b: int, arm: Strategy) -> float | None:
        """The best standing in bucket ``b`` of an arm that ``arm`` contains, among those run here."""
        standings = [self._standing(b, a, judged=arm) for a in self._narrower[arm] if self._stats[b][a].samples]
        standings = [s for s in standings if s is not None]
        return max(standings) if standings else None

    def _loses(self, b: int, arm: Strategy) -> bool:
        """Whether a measurement rules out exploring ``arm`` in bucket ``b`` (see the module doc)."""
        if not arm.speculative:
            return False
        cfg = self.config
        neighbour, narrower = self._neighbour_standing(b, arm), self._narrower_standing(b, arm)
        if neighbour is not None and neighbour < cfg.prune_ratio:
            return True
        if narrower is not None and narrower < cfg.width_prune_ratio:
            return True
        return cfg.speculate_up_to is not None and neighbour is None and cfg.bucket_bounds[b] > cfg.speculate_up_to

    def choose(self, num_active: int) -> Strategy:
        return self.plan(num_active).strategy

    def plan(self, num_active: int) -> Choice:
        """The arm for a step of ``num_active`` sequences, and how many of them draft in it."""
        b = self.bucket(num_active)
        stats, cfg = self._stats[b], self.config
        for arm in self._explore_order:
            if stats[arm].switched_only:  # its one step paid the catch-up: the next one measures the arm
                return Choice(arm, self._probe_size(b, num_active, arm))
            if arm is self._none:
                if not stats[arm].samples:
                    return Choice(arm)  # one plain step per bucket: the reference speeds are carried by
                continue
            if self.evidence(arm) < max(cfg.min_sequence_steps, 1) and not self._loses(b, arm):
                return Choice(arm, self._probe_size(b, num_active, arm))  # pooled: one large step suffices
        # exploited: the arms with a full step here; the others are carried here by the model
        ran = {a: p for a in self.arms if stats[a].full and (p := self.predicted(a, b)) is not None}
        if not ran:
            return Choice(self._explore_order[0], self._probe_size(b, num_active, self._explore_order[0]))
        best = max(ran, key=lambda a: ran[a])
        # an arm without a full step in this bucket is given one where its carried prediction (or
        # its probe's) comes close to the best measured here: carried and extrapolated times are
        # estimates, and a full step is what the bucket then goes by
        untried = [a for a in self.arms if a not in ran and self.evidence(a) and not self._loses(b, a)]
        carried = {a: p for a in untried if (p := self.predicted(a, b, num_active)) is not None}
        hopeful = [a for a in carried if carried[a] >= cfg.prune_ratio * ran[best] or self._far_below(b, a)]
        # ... and one measured close to the best gets full steps until three judge it
        hopeful += [
            a for a in ran if a is not best and len(stats[a].full) < 3 and ran[a] >= cfg.prune_ratio * ran[best]
        ]
        carried |= {a: ran[a] for a in hopeful if a in ran}
        if hopeful:
            arm = max(hopeful, key=lambda a: carried[a])
            return Choice(arm, self._probe_size(b, num_active, arm))
        if not best.speculative and cfg.reprobe_every and self._plain_run[b] >= cfg.reprobe_every:
            drafting = {a: p for a in self.arms if a.speculative and (p := self.predicted(a, b, num_active))}
            if drafting:  # the drafter may have caught up with the policy since its arms lost here
                arm = max(drafting, key=lambda a: drafting[a])
                m = cfg.probe_sequences
                return Choice(arm, m if 0 < m < num_active and num_active >= cfg.probe_from else None, reprobe=True)
        if cfg.policy == "epsilon":
            return Choice(self._rng.choice(list(ran)) if self._rng.random() < cfg.epsilon else best)
        counts = {a: max(1, sum(x.drafting for x in stats[a].full)) for a in ran}
        total = sum(counts.values())
        scale = ran[best] * cfg.ucb_c
        return Choice(max(ran, key=lambda a: ran[a] + scale * math.sqrt(math.log(max(total, 2)) / counts[a])))

    def _probe_size(self, b: int, num_active: int, arm: Strategy) -> int | None:
        """How many sequences draft in ``arm``'s first step on this batch: ``probe_sequences`` on a
        large batch whose plain step time is known and where the arm has not run (or ran only a
        probe that also paid the drafter's catch-up), every one otherwise (None)."""
        m, cfg = self.config.probe_sequences, self.config
        plain_known = self._none is not None and self._stats[b][self._none].speed is not None
        samples = self._stats[b][arm].samples
        first_here = all(x.probe and x.switch for x in samples)
        if arm.speculative and plain_known and first_here and 0 < m < num_active and num_active >= cfg.probe_from:
            return m
        return None

    def observe(
        self,
        num_active: int,
        arm: Strategy,
        tokens: int,
        seconds: float,
        drafting: int | None = None,
        draft_seconds: float = 0.0,
        switch: bool = False,
    ) -> bool:
        """Record a step: ``tokens`` emitted in ``seconds`` of step time by ``num_active`` sequences.

        A probe step (only ``drafting`` of the sequences drafted, the others took one token each)
        gives the drafting sequences' acceptance as measured, and the time the step would have
        taken with all of them drafting: the plain step's time for this batch (from plain
        decoding's speed here), plus the drafting (``draft_seconds``) as measured, plus the
        verification's extra time scaled to the whole batch. Extra verification rows cost in
        proportion on a CPU and less on a GPU below its compute bound; drafting for more sequences
        costs less than in proportion on either (one batched drafter forward). Where the estimate
        errs, it errs against the arm (it scales the spec step's fixed costs too), so once the arm
        has a full step anywhere its probes count for acceptance only. ``switch``: the step is a
        model-drafter arm's first after other arms (it paid the drafter's catch-up on their
        tokens, a cost of switching, not of the arm): its time is set aside while the arm has a
        steady step in the bucket.

        Returns whether the step resumed drafting in full in a bucket where plain decoding had won
        until a re-probe (``reprobe_every``) found a drafting arm worth running again."""
        if arm not in self._stats[0] or seconds <= 0 or num_active < 1:
            return False
        self._memo.clear()
        b = self.bucket(num_active)
        full = drafting is None or drafting >= num_active
        resumed = arm.speculative and full and self._reprobed[b]
        if arm.speculative:
            self._reprobed[b] = (self._reprobed[b] and not full) or (
                self.config.reprobe_every > 0 and self._plain_run[b] >= self.config.reprobe_every
            )
        self._plain_run[b] = 0 if arm.speculative else self._plain_run[b] + 1
        stats = self._stats[b]
        if full:
            stats[arm].add(Sample(num_active, num_active, float(tokens), seconds, switch=switch))
            self._judge_version(arm)
            return resumed
        drafting = max(drafting, 1)
        drafted_tokens = max(tokens - (num_active - drafting), drafting)
        plain_speed = stats[self._none].speed if self._none is not None else None
        full_s = seconds
        if plain_speed is not None:
            plain_s = num_active / plain_speed
            extra_verify_s = max(seconds - draft_seconds - plain_s, 0.0)
            full_s = plain_s + draft_seconds + extra_verify_s * num_active / drafting
        stats[arm].add(Sample(num_active, drafting, float(drafted_tokens), full_s, probe=True, switch=switch))
        self._judge_version(arm)
        return False

    def on_drafter_version(self, version: int) -> None:
        """The model drafter changed: mark what its arms measured as the old version's (``detect``),
        or forget most (``decay``) or all of it (``reset``)."""
        if self.drafter_version is not None and version != self.drafter_version:
            mode = self.config.drafter_update
            self._memo.clear()
            for stats in self._stats:
                for arm, s in stats.items():
                    if not arm.uses_model_drafter:
                        continue
                    if mode == "detect":
                        s.stale = len(s.samples)
                    else:
                        s.keep_newest(0 if mode == "reset" else self.config.decay_keep)
        self.drafter_version = version

    def _judge_version(self, arm: Strategy) -> None:
        """Once the new drafter version has ``detect_evidence`` drafting sequence-steps on ``arm``
        (all buckets), keep its old-version samples if its acceptance is within ``drift_tolerance``
        of theirs, else drop them."""
        stats = [s[arm] for s in self._stats]
        if not any(s.stale for s in stats):
            return
        fresh = [x for s in stats for x in s.fresh]
        fresh_drafting = sum(x.drafting for x in fresh)
        if fresh_drafting < self.config.detect_evidence:
            return
        old = [x for s in stats for x in list(s.samples)[: s.stale]]
        old_drafting = sum(x.drafting for x in old)
        old_accept = sum(x.tokens for x in old) / max(old_drafting, 1)
        new_accept = sum(x.tokens for x in fresh) / fresh_drafting
        moved = abs(new_accept / old_accept - 1) > self.config.drift_tolerance if old_accept > 0 else True
        for s in stats:
            if moved:
                s.replace(s.fresh)
            s.stale = 0
        if moved:
            logger.debug(
                "drafter version %s moved %s's acceptance %.2f -> %.2f: re-measuring it",
                self.drafter_version,
                arm,
                old_accept,
                new_accept,
            )

    def best(self, num_active: int) -> Strategy | None:
        """The arm with the highest predicted goodput among those run in the bucket (None before any)."""
        b = self.bucket(num_active)
        tried = [a for a in self.arms if self._stats[b][a].samples]
        return max(tried, key=lambda a: self.predicted(a, b)) if tried else None

    def estimates(self) -> dict[int, dict[str, tuple[float, int]]]:
        """Per bucket bound: arm -> (predicted goodput in tokens/s, samples in the window), for the
        arms run in the bucket."""
        out = {}
        for b, (bound, stats) in enumerate(zip(self.config.bucket_bounds, self._stats)):
            row = {str(a): (self.predicted(a, b), len(s.samples)) for a, s in stats.items() if s.samples}
            if row:
                out[bound] = row
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything it learned (JSON-serializable): the samples, trials, the drafter version they
        belong to and its exploration RNG, so a resumed run chooses as this one would."""
        version, internal, gauss = self._rng.getstate()
        return {
            "version": STATE_VERSION,
            "arms": [str(a) for a in self.arms],
            "bucket_bounds": list(self.config.bucket_bounds),
            "drafter_version": self.drafter_version,
            "samples": [
                {
                    str(a): [[x.sequences, x.drafting, x.tokens, x.seconds, x.probe, x.switch] for x in s.samples]
                    for a, s in stats.items()
                }
                for stats in self._stats
            ],
            "trials": [{str(a): s.trials for a, s in stats.items()} for stats in self._stats],
            "stale": [{str(a): s.stale for a, s in stats.items() if s.stale} for stats in self._stats],
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``. A state of other arms or buckets is an error; one saved by the
        per-bucket goodput selector of earlier releases is ignored with a warning (this one relearns
        it within a rollout)."""
        bounds = state.get("bucket_bounds", list(self.config.bucket_bounds))
        if state["arms"] != [str(a) for a in self.arms] or list(bounds) != list(self.config.bucket_bounds):
            raise ValueError("selector state was saved with other arms or buckets")
        if state.get("version") != STATE_VERSION:
            logger.warning("selector state of an earlier release (no version %d): starting from scratch", STATE_VERSION)
            return
        self.drafter_version = state["drafter_version"]
        self._memo.clear()
        stale = state.get("stale", [{} for _ in self._stats])  # states saved before "detect" have none
        for stats, saved, tried, marked in zip(self._stats, state["samples"], state["trials"], stale):
            for arm, s in stats.items():
                s.replace([Sample(*row) for row in saved[str(arm)]])
                s.trials = tried.get(str(arm), len(s.samples))
                s.stale = marked.get(str(arm), 0)
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
