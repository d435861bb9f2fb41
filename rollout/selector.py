"""Per-batch choice of the speculation strategy from measured goodput.

The number of active sequences picks a *bucket* (``bucket_bounds``: a bucket holds batch sizes up
to its bound); in each bucket every *arm* (a strategy) keeps a sliding window of rewards, the
goodput of the steps it ran there: tokens emitted per second of step time. ``choose`` first tries
every arm ``min_trials`` times (more on small batches, to cover ``min_sequence_steps``), then
exploits by UCB (mean plus a bonus that shrinks with the *sequence-steps* behind the mean, scaled
by the bucket's best mean) or epsilon-greedy. Evidence is counted in sequence-steps because one
step of 64 sequences averages 64 sequences' acceptance, where a step of one is one noisy draw: an
arm that lost on a full batch is not tried there again on an uncertainty bonus, and each retry of
a model-drafter arm after plain steps would also pay the drafter's catch-up. No batch-size threshold is needed: speculation turns itself off
wherever its measured goodput is lower than plain decoding's. A
configured ``speculate_up_to`` acts only as a prior (above it, plain decoding is tried first and
speculative arms need to beat it on measurements). A model-drafter arm's first step after plain
ones includes the drafter's catch-up on their tokens: a real cost of switching to it, which
``min_sequence_steps`` spreads over several trials on small batches.

Exploring costs most where the batch is large, and a rollout starts there. An untried arm is
skipped (kept at an estimate) when a measurement already says it loses: the same arm on a
smaller batch, below ``prune_ratio`` x the bucket's best (speculation returns less the more
sequences share a step), or, in the same bucket, every *narrower* arm of its drafters (fewer
draft nodes per sequence), below ``width_prune_ratio`` x the best -- a wider draft adds
verification rows for tokens accepted ever less often, so where ``chain:2`` loses,
``tree:4,2,8`` does not win. Narrow arms are therefore explored first. A skipped arm is not
exploited either (no bonus revives it) until the measurement that ruled it out changes.

When the model drafter's weights change (``on_drafter_version``), the estimates of the arms that
use it are decayed (only the newest ``decay_keep`` rewards stay) or reset; state persists across
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
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"SelectorConfig.{name} must be {allowed}, got {getattr(self, name)!r}")


@dataclass
class ArmStats:
    rewards: deque[float] = field(default_factory=deque)
    sizes: deque[int] = field(default_factory=deque)  # the batch size of each reward's step
    trials: int = 0  # all-time, for reporting

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    @property
    def sequence_steps(self) -> int:
        """The evidence behind the mean: one step of 64 sequences averages 64 sequences' drafts."""
        return sum(self.sizes)

    def add(self, reward: float, size: int) -> None:
        self.rewards.append(reward)
        self.sizes.append(size)
        self.trials += 1

    def keep_newest(self, keep: int) -> None:
        self.rewards = deque(list(self.rewards)[-keep:] if keep else [], maxlen=self.rewards.maxlen)
        self.sizes = deque(list(self.sizes)[-keep:] if keep else [], maxlen=self.sizes.maxlen)


class StrategySelector:
    """Bandit over strategies per batch-size bucket. ``has_model_drafter`` drops the arms that need one."""

    def __init__(self, config: SelectorConfig | None = None, *, has_model_drafter: bool = True) -> None:
        self.config = config or SelectorConfig()
        arms = [parse_strategy(a) for a in self.config.arms]
        self.arms: list[Strategy] = [a for a in arms if has_model_drafter or not a.uses_model_drafter]
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
            {a: ArmStats(deque(maxlen=w), deque(maxlen=w)) for a in self.arms} for _ in self.config.bucket_bounds
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

    def _relative(self, b: int, arm: Strategy) -> float | None:
        """``arm``'s goodput relative to the best arm of bucket ``b`` (None if not measured there)."""
        stats = self._stats[b]
        if not stats[arm].rewards:
            return None
        return stats[arm].mean / max(s.mean for s in stats.values() if s.rewards)

    def _neighbour_estimate(self, b: int, arm: Strategy) -> float | None:
        """Goodput ``arm`` would have in bucket ``b``, from the nearest *smaller-batch* bucket that
        measured it (its ratio to that bucket's best, times bucket ``b``'s best so far).

        Only smaller batches count: speculation returns less the more sequences share a step, so
        an arm that loses on fewer sequences will lose on more, but one that loses on a large batch
        may well win in the tail. Rollouts drain from large batches to small, so larger buckets are
        measured first; letting them prune would keep speculation out of the tail for good."""
        measured = [s.mean for s in self._stats[b].values() if s.rewards]
        if not measured:
            return None
        for nb in range(b - 1, -1, -1):
            if len(self._stats[nb][arm].rewards) >= self._trials_needed(nb):
                return self._relative(nb, arm) * max(measured)
        return None

    def _narrower_estimate(self, b: int, arm: Strategy) -> float | None:
        """The best goodput measured in bucket ``b`` by an arm that ``arm`` contains."""
        stats = self._stats[b]
        narrower = [stats[a].mean for a in self._narrower[arm] if stats[a].rewards]
        return max(narrower) if narrower else None

    def choose(self, num_active: int) -> Strategy:
        b = self.bucket(num_active)
        stats = self._stats[b]
        estimates: dict[Strategy, float] = {}
        best = max((s.mean for s in stats.values() if s.rewards), default=None)
        cfg, needed = self.config, self._trials_needed(b)
        for arm in self._explore_order:
            if len(stats[arm].rewards) >= needed:
                continue
            if stats[arm].rewards or best is None:
                return arm
            neighbour, narrower = self._neighbour_estimate(b, arm), self._narrower_estimate(b, arm)
            losses = [
                g
                for g, ratio in ((neighbour, cfg.prune_ratio), (narrower, cfg.width_prune_ratio))
                if g is not None and g < ratio * best
            ]
            if not losses and arm.speculative and cfg.speculate_up_to is not None:
                if neighbour is None and cfg.bucket_bounds[b] > cfg.speculate_up_to:
                    losses = [0.5 * best]  # the prior: speculation loses here
            if losses:
                estimates[arm] = min(losses)  # a measurement says it loses clearly: do not pay to explore it
                continue
            return arm
        # an arm a measurement says loses clearly (``estimates``) is neither explored nor exploited
        # until that measurement changes; the others are judged by UCB over sequence-steps
        candidates = [a for a in self.arms if a not in estimates]
        means = {a: stats[a].mean for a in candidates}
        best = max(candidates, key=lambda a: means[a])
        if self.config.policy == "epsilon":
            return self._rng.choice(candidates) if self._rng.random() < self.config.epsilon else best
        counts = {a: max(1, stats[a].sequence_steps) for a in candidates}
        total = sum(counts.values())
        scale = means[best] * self.config.ucb_c
        return max(candidates, key=lambda a: means[a] + scale * math.sqrt(math.log(total) / counts[a]))

    def observe(self, num_active: int, arm: Strategy, tokens: int, seconds: float) -> None:
        """Record a step's goodput (``tokens`` emitted in ``seconds`` of step time)."""
        if arm not in self._stats[0] or seconds <= 0:
            return
        self._stats[self.bucket(num_active)][arm].add(tokens / seconds, num_active)

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
        tried = [a for a in self.arms if stats[a].rewards]
        return max(tried, key=lambda a: stats[a].mean) if tried else None

    def estimates(self) -> dict[int, dict[str, tuple[float, int]]]:
        """Per bucket bound: arm -> (mean goodput in tokens/s, rewards in the window), for tried buckets."""
        out = {}
        for bound, stats in zip(self.config.bucket_bounds, self._stats):
            row = {str(a): (s.mean, len(s.rewards)) for a, s in stats.items() if s.rewards}
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
            "rewards": [{str(a): list(s.rewards) for a, s in stats.items()} for stats in self._stats],
            "sizes": [{str(a): list(s.sizes) for a, s in stats.items()} for stats in self._stats],
            "trials": [{str(a): s.trials for a, s in stats.items()} for stats in self._stats],
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["arms"] != [str(a) for a in self.arms] or len(state["rewards"]) != len(self._stats):
            raise ValueError("selector state was saved with other arms or buckets")
        self.drafter_version = state["drafter_version"]
        trials = state.get("trials") or [{} for _ in self._stats]
        sizes = state.get("sizes") or [{} for _ in self._stats]
        for b, (stats, saved, tried, sized) in enumerate(zip(self._stats, state["rewards"], trials, sizes)):
            for arm, s in stats.items():
                s.rewards = deque(saved[str(arm)], maxlen=self.config.window)
                # a state saved before sizes were kept: the bucket's smallest batch, a lower bound
                s.sizes = deque(sized.get(str(arm), [self._smallest(b)] * len(s.rewards)), maxlen=self.config.window)
                s.trials = tried.get(str(arm), len(s.rewards))
        if "rng" in state:
            version, internal, gauss = state["rng"]
            self._rng.setstate((version, tuple(internal), gauss))
