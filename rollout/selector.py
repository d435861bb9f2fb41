"""Per-batch choice of the speculation strategy from measured goodput.

The number of active sequences picks a *bucket* (``bucket_bounds``: a bucket holds batch sizes up
to its bound); in each bucket every *arm* (a strategy) keeps a sliding window of samples, the
goodput of the steps it ran there: tokens emitted per second of step time. ``plan`` first tries
every arm ``min_trials`` times (more on small batches, to cover ``min_sequence_steps``), then
exploits by UCB (mean plus a bonus that shrinks with the *sequence-steps* behind the mean, scaled
by the bucket's best mean) or epsilon-greedy. Evidence is counted in sequence-steps because one
step of 64 sequences averages 64 sequences' acceptance, where a step of one is one noisy draw: an
arm that lost on a full batch is not tried there again on an uncertainty bonus (each retry of a
model-drafter arm after plain steps would also pay the drafter's catch-up). No batch-size
threshold is needed: speculation turns itself off wherever its measured goodput is lower than
plain decoding's. A configured ``speculate_up_to`` acts only as a prior (above it, plain decoding
is tried first and speculative arms need to beat it on measurements).

Exploring costs most where the batch is large, and a rollout starts there. So:

* An arm's first try on a large batch (``probe_from`` sequences or more) is a *probe*: only
  ``probe_sequences`` of the batch draft, the others take their plain token in the same forward,
  and the goodput the full step would have had is extrapolated (``observe``). A probe that says
  the arm loses clearly (below ``prune_ratio`` of the bucket's best) spares the full step;
  otherwise a full step measures the arm.
* An untried arm is skipped when a measurement already says it loses: the same arm on a smaller
  batch, below ``prune_ratio`` of the best there (speculation returns less the more sequences
  share a step), or, in the same bucket, every *narrower* arm of its drafters (fewer draft nodes
  per sequence), below ``width_prune_ratio`` of the best -- a wider draft adds verification rows
  for tokens accepted ever less often, so where ``chain:2`` loses, ``tree:4,2,8`` does not win.
  Narrow arms are therefore explored first. A skipped arm is not exploited either (no bonus
  revives it) until the measurement that ruled it out changes.

These standings compare arms by their goodput relative to plain decoding's *at the time* of each
step: every step slows down as contexts grow, so goodputs measured minutes apart are not
comparable, their ratios to plain decoding then are.

When the model drafter's weights change (``on_drafter_version``), the samples of the arms that
use it are decayed (only the newest ``decay_keep`` stay) or reset; state persists across
``generate`` calls (RL steps) otherwise, and can be saved with ``state_dict``.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .strategy import Strategy, parse_strategy

POLICIES = ("ucb", "epsilon")
DEFAULT_ARMS = ("none", "chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid:4,2,12")


@dataclass
class SelectorConfig:
    arms: tuple[str, ...] = DEFAULT_ARMS
    bucket_bounds: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
    policy: str = "ucb"
    ucb_c: float = 0.1  # exploration bonus, as a fraction of the bucket's best mean goodput
    epsilon: float = 0.05
    window: int = 32  # rewards kept per (bucket, arm)
    min_trials: int = 1  # tries of every arm in a bucket before exploiting
    min_sequence_steps: int = 8  # ... and at least this many sequence-steps (trials x batch size)
    speculate_up_to: int | None = None  # prior: above this many active sequences, try "none" first
    prune_ratio: float = 0.7  # skip exploring an arm a smaller batch measured below this x the bucket's best
    width_prune_ratio: float = 0.9  # ... or whose every narrower arm measured below this x the best here
    probe_sequences: int = 8  # a first try on a large batch drafts for this many sequences only (0: never)
    probe_from: int = 32  # ... on batches of at least this many
    drafter_update: str = "decay"  # what a new drafter version does to model-drafter arms: decay | reset
    decay_keep: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        self.arms = tuple(self.arms)
        self.bucket_bounds = tuple(self.bucket_bounds)
        if not self.arms:
            raise ValueError("SelectorConfig.arms must name at least one strategy")
        for arm in self.arms:
            if parse_strategy(arm).adaptive:
                raise ValueError("SelectorConfig.arms cannot contain 'adaptive'")
        if (
            not self.bucket_bounds
            or any(b < 1 for b in self.bucket_bounds)
            or list(self.bucket_bounds) != sorted(set(self.bucket_bounds))
        ):
            raise ValueError(
                f"SelectorConfig.bucket_bounds must be increasing ints >= 1, got {list(self.bucket_bounds)}"
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
            ("drafter_update", self.drafter_update in ("decay", "reset"), "'decay' or 'reset'"),
            ("decay_keep", isinstance(self.decay_keep, int) and self.decay_keep >= 0, "an int >= 0"),
            ("prune_ratio", 0 <= self.prune_ratio <= 1, "a float in [0, 1]"),
            ("width_prune_ratio", 0 <= self.width_prune_ratio <= 1, "a float in [0, 1]"),
            ("probe_sequences", isinstance(self.probe_sequences, int) and self.probe_sequences >= 0, "an int >= 0"),
            ("probe_from", isinstance(self.probe_from, int) and self.probe_from >= 1, "an int >= 1"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SelectorConfig.{name} must be {allowed}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Choice:
    """The selector's pick for one step: the arm, and how many of the batch draft in it (None: all;
    a number: a *probe*, the arm's first try on a large batch, paid on a few sequences only)."""

    strategy: Strategy
    drafting: int | None = None


@dataclass(frozen=True)
class Sample:
    """One step's reward: its goodput, the sequences that drafted in it (the evidence: one step
    of 64 sequences averages 64 sequences' drafts), its goodput relative to plain decoding's in
    the bucket at the time (None before plain decoding was measured there; plain steps slow down
    as contexts grow, so a ratio taken at the time stays comparable where goodputs measured at
    different times do not), whether it is a probe's extrapolation, and whether it is a *switch*:
    a model-drafter arm's first step after steps of other arms, which also paid the drafter's
    catch-up on every token those steps emitted (a cost of switching, not of the arm)."""

    goodput: float
    sequences: int
    vs_plain: float | None = None
    probe: bool = False
    switch: bool = False  # a model-drafter arm's first step after others: it paid the drafter's catch-up


@dataclass
class ArmStats:
    samples: deque[Sample] = field(default_factory=deque)
    trials: int = 0  # all-time, for reporting

    @property
    def rewards(self) -> list[float]:
        return [x.goodput for x in self.samples]

    @property
    def judged(self) -> list[Sample]:
        """The samples the arm is judged by: switch steps only while it has no other (a catch-up
        after many plain steps would otherwise condemn an arm that wins once it runs)."""
        steady = [x for x in self.samples if not x.switch]
        return steady or list(self.samples)

    @property
    def mean(self) -> float:
        judged = self.judged
        return sum(x.goodput for x in judged) / len(judged) if judged else 0.0

    @property
    def vs_plain(self) -> float | None:
        """Mean goodput relative to plain decoding at the time of each step (None if never known)."""
        ratios = [x.vs_plain for x in self.judged if x.vs_plain is not None]
        return sum(ratios) / len(ratios) if ratios else None

    @property
    def sequence_steps(self) -> int:
        return sum(x.sequences for x in self.judged)

    @property
    def probed_only(self) -> bool:
        return bool(self.samples) and all(x.probe for x in self.samples)

    @property
    def switched_only(self) -> bool:
        return bool(self.samples) and all(x.switch and not x.probe for x in self.samples)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        self.trials += 1

    def keep_newest(self, keep: int) -> None:
        self.samples = deque(list(self.samples)[-keep:] if keep else [], maxlen=self.samples.maxlen)


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
        # the order untried arms are explored in: plain decoding first (the baseline the others are
        # compared with), then the speculative arms, narrowest draft first
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
        self.drafter_version: int | None = None

    def bucket(self, num_active: int) -> int:
        """Index of the bucket holding ``num_active`` sequences (the last bucket holds all larger)."""
        return min(bisect_left(self.config.bucket_bounds, num_active), len(self.config.bucket_bounds) - 1)

    def _trials_needed(self, b: int) -> int:
        """Tries of an arm in bucket ``b`` before its mean is trusted: ``min_trials``, and enough
        for ``min_sequence_steps`` at the bucket's smallest batch. One step of one sequence is a
        noisy sample (a suffix draft hits or misses; the first model-drafter step after plain
        ones also pays the drafter's catch-up), one step of 64 sequences averages 64 of them."""
        return max(self.config.min_trials, math.ceil(self.config.min_sequence_steps / self._smallest(b)))

    def _smallest(self, b: int) -> int:
        """The smallest batch size bucket ``b`` holds."""
        return self.config.bucket_bounds[b - 1] + 1 if b else 1

    def _standing(self, b: int, arm: Strategy) -> float | None:
        """``arm``'s goodput relative to the best arm of bucket ``b`` (None if not measured there),
        from ratios to plain decoding taken at the time where they exist."""
        stats = self._stats[b]
        if not stats[arm].samples:
            return None
        plain = stats[self._none] if self._none is not None else None
        if plain is None or not plain.samples:
            return stats[arm].mean / max(s.mean for s in stats.values() if s.samples)

        def ratio(a: Strategy) -> float:
            own = stats[a].vs_plain
            return 1.0 if a is self._none else own if own is not None else stats[a].mean / plain.mean

        return ratio(arm) / max(ratio(a) for a in self.arms if stats[a].samples)

    def _neighbour_standing(self, b: int, arm: Strategy) -> float | None:
        """``arm``'s standing in the nearest *smaller-batch* bucket that measured it enough.

        Only smaller batches count: speculation returns less the more sequences share a step, so
        an arm that loses on fewer sequences will lose on more, but one that loses on a large batch
        may well win in the tail. Rollouts drain from large batches to small, so larger buckets are
        measured first; letting them prune would keep speculation out of the tail for good."""
        for nb in range(b - 1, -1, -1):
            if len(self._stats[nb][arm].samples) >= self._trials_needed(nb):
                return self._standing(nb, arm)
        return None

    def _narrower_standing(self, b: int, arm: Strategy) -> float | None:
        """The best standing in bucket ``b`` of an arm that ``arm`` contains."""
        standings = [self._standing(b, a) for a in self._narrower[arm] if self._stats[b][a].samples]
        return max(standings) if standings else None

    def choose(self, num_active: int) -> Strategy:
        return self.plan(num_active).strategy

    def plan(self, num_active: int) -> Choice:
        """The arm for a step of ``num_active`` sequences, and how many of them draft in it."""
        b = self.bucket(num_active)
        stats = self._stats[b]
        ruled_out: set[Strategy] = set()
        measured = any(s.samples for s in stats.values())
        cfg, needed = self.config, self._trials_needed(b)
        for arm in self._explore_order:
            if stats[arm].switched_only:
                return Choice(arm)  # its one step paid the catch-up: the next one measures the arm
            if stats[arm].probed_only:
                if self._standing(b, arm) < cfg.prune_ratio:
                    continue  # its probe says it loses clearly: no full step is paid for
                return Choice(arm)  # close or better: a full step measures it
            if len(stats[arm].samples) >= needed:
                continue
            if stats[arm].samples or not measured:
                return Choice(arm)
            neighbour, narrower = self._neighbour_standing(b, arm), self._narrower_standing(b, arm)
            loses = any(
                g is not None and g < ratio
                for g, ratio in ((neighbour, cfg.prune_ratio), (narrower, cfg.width_prune_ratio))
            )
            if not loses and arm.speculative and cfg.speculate_up_to is not None:
                loses = neighbour is None and cfg.bucket_bounds[b] > cfg.speculate_up_to  # the prior
            if loses:
                ruled_out.add(arm)  # a measurement says it loses clearly: do not pay to explore it
                continue
            return Choice(arm, self._probe_size(b, num_active, arm))
        # an arm a measurement rules out is neither explored nor exploited until that measurement
        # changes; the others are judged by UCB over sequence-steps
        candidates = [a for a in self.arms if a not in ruled_out]
        means = {a: stats[a].mean for a in candidates}
        best = max(candidates, key=lambda a: means[a])
        if self.config.policy == "epsilon":
            return Choice(self._rng.choice(candidates) if self._rng.random() < self.config.epsilon else best)
        counts = {a: max(1, stats[a].sequence_steps) for a in candidates}
        total = sum(counts.values())
        scale = means[best] * self.config.ucb_c
        return Choice(max(candidates, key=lambda a: means[a] + scale * math.sqrt(math.log(total) / counts[a])))

    def _probe_size(self, b: int, num_active: int, arm: Strategy) -> int | None:
        """How many sequences draft in ``arm``'s first step on this batch: ``probe_sequences`` on a
        large batch whose plain step time is known, every one otherwise (None)."""
        m, cfg = self.config.probe_sequences, self.config
        plain_known = self._none is not None and bool(self._stats[b][self._none].samples)
        if arm.speculative and plain_known and 0 < m < num_active and num_active >= cfg.probe_from:
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
    ) -> None:
        """Record a step's goodput (``tokens`` emitted in ``seconds`` of step time).

        A probe step (only ``drafting`` of the sequences drafted, the others took one token each)
        is recorded as the goodput the step would have had with all of them drafting: the plain
        step's time for this batch (from plain decoding's goodput here), plus the drafting
        (``draft_seconds``) as measured, plus the verification's extra time and the extra tokens
        scaled to the whole batch. Extra verification rows cost in proportion on a CPU and less on
        a GPU below its compute bound; drafting for more sequences costs less than in proportion
        on either (one batched drafter forward). Where the estimate errs, it errs in the arm's
        favour, and a full step then measures the arm: a probe only spares the full step of an
        arm that loses clearly even so. ``switch``: the step is a model-drafter arm's first after
        other arms (it paid the drafter's catch-up); the arm's first such step in a bucket counts
        only until a steady step replaces it, later ones count as they ran (each re-try after
        other arms pays a catch-up again)."""
        if arm not in self._stats[0] or seconds <= 0:
            return
        stats = self._stats[self.bucket(num_active)]
        # only an arm's first step in a bucket is judged apart as a switch: it caught up on the whole
        # rollout so far; later switches (re-tries after other arms) are a price of switching back
        switch = switch and not stats[arm].samples
        plain = stats[self._none] if self._none is not None else None
        plain_goodput = plain.mean if plain is not None and plain.samples else None
        if drafting is None or drafting >= num_active or plain_goodput is None:
            goodput = tokens / seconds
            vs_plain = None if plain_goodput is None or arm is self._none else goodput / plain_goodput
            stats[arm].add(Sample(goodput, num_active, vs_plain, switch=switch))
            return
        scale, plain_s = num_active / max(drafting, 1), num_active / plain_goodput
        extra_verify_s = max(seconds - draft_seconds - plain_s, 0.0)
        full_s = plain_s + draft_seconds + extra_verify_s * scale
        full = (num_active + max(tokens - num_active, 0) * scale) / full_s
        stats[arm].add(Sample(full, drafting, full / plain_goodput, probe=True, switch=switch))

    def on_drafter_version(self, version: int) -> None:
        """The model drafter changed: forget (most of) what its arms measured."""
        if self.drafter_version is not None and version != self.drafter_version:
            keep = 0 if self.config.drafter_update == "reset" else self.config.decay_keep
            for stats in self._stats:
                for arm, s in stats.items():
                    if arm.uses_model_drafter:
                        s.keep_newest(keep)
        self.drafter_version = version

    def best(self, num_active: int) -> Strategy | None:
        """The arm with the highest mean goodput in the bucket (None before any observation)."""
        stats = self._stats[self.bucket(num_active)]
        tried = [a for a in self.arms if stats[a].samples]
        return max(tried, key=lambda a: stats[a].mean) if tried else None

    def estimates(self) -> dict[int, dict[str, tuple[float, int]]]:
        """Per bucket bound: arm -> (mean goodput in tokens/s, rewards in the window), for tried buckets."""
        out = {}
        for bound, stats in zip(self.config.bucket_bounds, self._stats):
            row = {str(a): (s.mean, len(s.samples)) for a, s in stats.items() if s.samples}
            if row:
                out[bound] = row
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything it learned (JSON-serializable): goodput windows, trials, the drafter version
        they belong to and its exploration RNG, so a resumed run chooses as this one would."""
        version, internal, gauss = self._rng.getstate()
        return {
            "arms": [str(a) for a in self.arms],
            "drafter_version": self.drafter_version,
            "rewards": [{str(a): s.rewards for a, s in stats.items()} for stats in self._stats],
            "samples": [
                {str(a): [[x.sequences, x.vs_plain, x.probe, x.switch] for x in s.samples] for a, s in stats.items()}
                for stats in self._stats
            ],
            "trials": [{str(a): s.trials for a, s in stats.items()} for stats in self._stats],
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["arms"] != [str(a) for a in self.arms] or len(state["rewards"]) != len(self._stats):
            raise ValueError("selector state was saved with other arms or buckets")
        self.drafter_version = state["drafter_version"]
        trials = state.get("trials") or [{} for _ in self._stats]
        # states saved before samples kept more than goodput: the bucket's smallest batch (a lower bound)
        extra = state.get("samples") or [{} for _ in self._stats]
        for b, (stats, saved, tried, more) in enumerate(zip(self._stats, state["rewards"], trials, extra)):
            for arm, s in stats.items():
                rest = more.get(str(arm)) or [[self._smallest(b), None, False]] * len(saved[str(arm)])
                s.samples = deque(
                    (Sample(g, *extra) for g, extra in zip(saved[str(arm)], rest)), maxlen=self.config.window
                )
                s.trials = tried.get(str(arm), len(s.samples))
        if "rng" in state:
            version, internal, gauss = state["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
