"""A rollout simulator that makes regressions of ``adaptive`` impossible to miss.

A :class:`Regime` is a machine and a drafter: the true seconds of a target forward (padded to graph
buckets on a GPU, linear in its rows on a CPU), a drafter forward per draft level, the suffix
drafter's host cost, a catch-up per token the model drafter missed, a capture on each new padded
shape, log-normal step noise with a share of steps at 2x, and a per-level acceptance for each arm
kind that may drift with every drafter version. :func:`simulate` runs ``rl_steps`` rollouts of a
long-tailed batch split over ``workers``; each worker drains its share with the engine's own
``StrategyChoice`` and ``StrategySelector`` (calibrated on the regime's forward, as the engine
times its model), and the workers' acceptance books merge after every rollout, as at a policy
sync. Every fixed arm and a per-step oracle (the arm of the best noise-free goodput at each step's
batch size) run the same rollouts. A rollout's time is its slowest worker's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..rollout.adaptive.acceptance import AcceptanceBook
from ..rollout.adaptive.choice import StepOutcome, StrategyChoice
from ..rollout.adaptive.forward_table import ForwardTable, calibrate, calibration_shapes
from ..rollout.model.graph_pool import _round_up
from ..rollout.params import DEFAULT_ARMS, RolloutConfig, SelectorConfig
from ..rollout.strategy import Strategy, parse_strategy

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32)


def graph_pad(n: int, t: int) -> tuple[int, int]:
    return _round_up(n, BATCH_BUCKETS) or n, _round_up(t, TOKEN_BUCKETS) or t


@dataclass(frozen=True)
class Regime:
    name: str
    forward_s: float  # a one-token forward
    row_s: float  # each further row of a forward
    padded: bool  # CUDA graphs: shapes run padded to their buckets
    level_s: float  # a model-drafter forward per draft level ...
    level_row_s: float  # ... and per row in it
    suffix_node_s: float  # the suffix drafter's host time per drafted node
    catch_up_token_s: float  # the model drafter's catch-up per token it missed
    hazard: dict[str, float]  # per arm kind: P(the next draft level is accepted)
    capture_s: float = 0.0  # a graph capture, once per new padded shape
    noise: float = 0.05  # log-normal sigma of a step's time
    spikes: float = 0.0  # share of steps at 2x (a collection, another process)
    drift: float = 0.0  # the model drafter's acceptance moves by up to this (relative) per version
    version_every: int = 0  # steps between drafter versions inside a rollout (0: one per rollout)
    compute_row_s: float = 0.0  # a roofline: past forward_s / compute_row_s rows a forward is compute-bound
    tree_level: float = 1.0  # a tree's draft level costs this x a chain level of as many rows (host ranking)
    shift_at: int = 0  # from this rollout on (0: never) ...
    shift_draft: float = 1.0  # ... a model-drafter level costs this x (sampled drafting after greedy)

    def at_rollout(self, r: int) -> Regime:
        """The machine as rollout ``r`` finds it."""
        if not self.shift_at or r < self.shift_at:
            return self
        return replace(self, level_s=self.level_s * self.shift_draft, level_row_s=self.level_row_s * self.shift_draft)

    def forward(self, n: int, t: int) -> float:
        if self.padded:
            n, t = graph_pad(n, t)
        return max(self.forward_s, self.compute_row_s * n * t) + self.row_s * n * t


GPU_HAZARD = {"chain": 0.8, "tree": 0.86, "hybrid": 0.87, "suffix": 0.45, "mirror": 0.8}
REGIMES = {
    # a bandwidth-bound GPU step: ~flat in the batch up to the compute bound, graph buckets
    "gpu": Regime("gpu", 4.5e-3, 2e-6, True, 0.6e-3, 3e-6, 4e-6, 2e-5, GPU_HAZARD, capture_s=0.08),
    # a compute-bound CPU: every row costs the same, so speculation loses past a handful of sequences
    "cpu": Regime("cpu", 2e-3, 1e-3, False, 1e-4, 1e-4, 2e-5, 1e-4, {**GPU_HAZARD, "chain": 0.7}),
    # a GPU past its roofline: flat up to ~17 rows, compute-bound beyond, so chain:4 wins small
    # batches, chain:2 the middle and plain decoding large ones
    "crossover": Regime(
        "crossover", 5e-3, 0.0, True, 0.6e-3, 3e-6, 4e-6, 2e-5, GPU_HAZARD, capture_s=0.08, compute_row_s=0.3e-3
    ),
    # a GPU whose host is the bottleneck (docs/GPU.md): the drafter LM's per-sequence host work grows with the
    # batch much faster than the target's bandwidth-bound forward, so chain arms win batch 1 and
    # lose large batches, and one drafting ratio for all batch sizes mispredicts both ends; a
    # tree's level costs more than a chain's of as many rows (its branches ranked on the host)
    "gpu_host": Regime(
        "gpu_host", 4e-3, 8e-5, True, 1.3e-3, 1.2e-4, 4e-6, 2e-5, GPU_HAZARD, capture_s=0.08, tree_level=1.6
    ),
    "noisy": Regime(
        "noisy", 4.5e-3, 2e-6, True, 0.6e-3, 3e-6, 4e-6, 2e-5, GPU_HAZARD, capture_s=0.08, noise=0.25, spikes=0.05
    ),
    "drifting": Regime(
        "drifting", 10e-3, 0.3e-3, False, 0.8e-3, 3e-5, 2e-5, 5e-5, GPU_HAZARD, drift=0.15, version_every=40
    ),
    # a sampled long tail after greedy batches, whose drafter LM drafts at a few times the cost the
    # selector learned (as seen on a GPU, docs/GPU.md); here drafting costs 3x from the fourth rollout on
    "shifting": Regime(
        "shifting",
        4.5e-3,
        2e-6,
        True,
        0.6e-3,
        3e-6,
        4e-6,
        2e-5,
        GPU_HAZARD,
        capture_s=0.08,
        shift_at=3,
        shift_draft=3.0,
    ),
}


@dataclass
class _Drafter:
    version: int = 0


@dataclass
class _Worker:
    """One worker's engine-side state in a run: captured shapes, the drafter's lag, its choice."""

    captured: set = field(default_factory=set)
    choice: StrategyChoice | None = None
    drafter: _Drafter | None = None


def _hazards(regime: Regime, rng: np.random.Generator, versions: int) -> list[dict[str, float]]:
    """The acceptance per level of each version: the model drafter's arms move together."""
    out = []
    for _ in range(versions):
        factor = 1 + regime.drift * rng.uniform(-1, 1)
        out.append({k: min(h * factor, 0.95) if k != "suffix" else h for k, h in regime.hazard.items()})
    return out


def _expected_emit(arm: Strategy, hazard: dict[str, float]) -> float:
    if not arm.speculative:
        return 1.0
    h = hazard[arm.kind]
    return 1 + sum(h**j for j in range(1, arm.shape.depth + 1))


def _true_seconds(regime: Regime, arm: Strategy, n: int, lag: int) -> tuple[float, float]:
    """Noise-free (step, drafting) seconds of a step of ``arm`` on ``n`` sequences."""
    seconds, draft = regime.forward(n, 1 + arm.max_draft_nodes), 0.0
    if arm.uses_model_drafter:
        width = math.ceil(arm.shape.max_nodes / arm.shape.depth)
        level = arm.shape.depth * (regime.level_s + regime.level_row_s * n * width)
        draft += level * (1.0 if arm.shape.is_chain else regime.tree_level)
        if lag:
            draft += regime.level_s + regime.catch_up_token_s * lag
    if "suffix" in arm.drafters:
        draft += regime.suffix_node_s * n * arm.max_draft_nodes
    return seconds + draft, draft


def _noise(regime: Regime, rng: np.random.Generator) -> float:
    return math.exp(rng.normal(0, regime.noise)) * (2.0 if rng.random() < regime.spikes else 1.0)


def _choice(regime: Regime, arms: tuple[str, ...], max_batch: int, rng: np.random.Generator, worker: _Worker) -> None:
    """The worker's engine-side choice, calibrated on the regime's forward (the shapes it timed
    are captured, as the engine's calibration captures them)."""

    def time_forward(n: int, t: int) -> float:
        return regime.forward(n, t) * _noise(regime, rng)

    def calibrated(config: SelectorConfig, strategies, up_to: int, known: ForwardTable | None, fresh: bool):
        widths = [1 + a.max_draft_nodes for a in strategies]
        pad = graph_pad if regime.padded else None
        shapes = calibration_shapes(widths, up_to, config.calibration_rows, pad)
        worker.captured |= set(shapes) if pad is not None else set()
        return ForwardTable(calibrate(time_forward, shapes, config.calibration_repeats), pad)

    config = RolloutConfig(strategy="adaptive", selector=SelectorConfig(arms=arms))
    worker.drafter = _Drafter()
    worker.choice = StrategyChoice(config, worker.drafter, calibrated)
    worker.choice.set("adaptive")
    worker.choice.calibrate(max_batch, fresh=False)  # the engine's before its first rollout


@dataclass
class Contender:
    """``fixed``: an arm; None: adaptive; "oracle": the per-step oracle."""

    name: str
    arm: Strategy | None
    seconds: list[float] = field(default_factory=list)  # per rollout: the slowest worker's
    steps: int = 0
    off_first: int = 0  # adaptive: steps on an arm its point estimates ranked below the first, beyond their error
    picks: dict[str, int] = field(default_factory=dict)  # adaptive: steps per arm


PROMPT = 128  # tokens of each prompt, which a model drafter catches up on at its first draft


def _drain(regime, contender, worker, lengths, hazards, version0, rng, max_new) -> float:
    """One worker's share of a rollout; returns its seconds."""
    remaining = lengths.copy()
    generated = np.full_like(lengths, PROMPT)  # a sequence's tokens, its prompt's included
    seen = np.zeros_like(lengths)  # tokens of each sequence the model drafter has caught up on
    total, step = 0.0, 0
    arms = [parse_strategy(a) for a in DEFAULT_ARMS]
    while (active := np.flatnonzero(remaining > 0)).size:
        n = int(active.size)
        version = version0 + (step // regime.version_every if regime.version_every else 0)
        hazard = hazards[min(version, len(hazards) - 1)]
        lag = int((generated[active] - seen[active]).sum())  # what a model arm feeds first, prompts included
        met = seen[active] > 0  # the engine's DrafterLag owes only what sequences the drafter met emitted since
        owed = int((generated[active] - seen[active])[met].sum())
        if contender.name == "oracle":
            arm = max(arms, key=lambda a: n * _expected_emit(a, hazard) / _true_seconds(regime, a, n, 0)[0])
        elif contender.arm is None:
            selector = worker.choice.selector
            worker.drafter.version = version
            to_go = int((PROMPT + max_new - generated[active]).sum())
            plan = worker.choice.plan(n, to_go, owed)
            arm = plan.strategy
            # point estimates: off where the arm run is ranked below the first beyond the model's error
            ranked = selector.predictions(n, to_go, owed, optimism=0.0)
            chosen = next(p.finish_s for p in ranked if p.arm == arm)
            contender.off_first += chosen > ranked[0].finish_s * math.exp(selector.error)
        else:
            arm = contender.arm
        seconds, draft = _true_seconds(regime, arm, n, lag if arm.uses_model_drafter else 0)
        noise = _noise(regime, rng)
        seconds, draft = seconds * noise, draft * noise
        shape = graph_pad(n, 1 + arm.max_draft_nodes) if regime.padded else None
        capture = regime.capture_s if shape is not None and shape not in worker.captured else 0.0
        if shape is not None:
            worker.captured.add(shape)
        depth = np.zeros(n, dtype=int)
        accepted = np.zeros(n, dtype=int)
        if arm.speculative:
            depth = np.minimum(arm.shape.depth, remaining[active] - 1)
            accepted = np.minimum(rng.geometric(1 - hazard[arm.kind], n) - 1, depth)
        emitted = np.minimum(1 + accepted, remaining[active])
        remaining[active] -= emitted
        generated[active] += emitted
        if worker.choice is not None:
            one_off = capture > 0 or (arm.uses_model_drafter and not met.all())  # as the engine marks them
            outcome = StepOutcome(seconds, draft, one_off)
            if arm.speculative:
                drafted = np.where(depth > 0, depth if arm.shape.is_chain else arm.max_draft_nodes, 0)
                outcome = StepOutcome(seconds, draft, one_off, drafted.tolist(), accepted.tolist())
            worker.choice.record(plan, n, outcome)
            contender.picks[str(arm)] = contender.picks.get(str(arm), 0) + 1
        if arm.uses_model_drafter:
            seen[active] = generated[active]
        total += seconds + capture
        step += 1
        contender.steps += 1
    return total


def simulate(
    regime: Regime | str,
    seed: int,
    *,
    rl_steps: int = 6,
    workers: int = 2,
    batch: int = 64,
    max_new: int = 512,
    arms: tuple[str, ...] = DEFAULT_ARMS,
) -> dict[str, Contender]:
    """Every fixed arm of ``arms``, ``adaptive`` and the oracle over the same ``rl_steps`` rollouts of
    ``batch`` long-tailed completions (median ~90 tokens, up to ``max_new``) on ``workers``."""
    regime = REGIMES[regime] if isinstance(regime, str) else regime
    rng = np.random.default_rng(seed)
    rollouts = [np.clip(rng.lognormal(4.5, 0.9, batch).astype(int), 8, max_new) for _ in range(rl_steps)]
    per_rollout = 1 + (max_new // regime.version_every if regime.version_every else 0)
    hazards = _hazards(regime, rng, rl_steps * per_rollout)
    contenders = [Contender(a, parse_strategy(a)) for a in arms] + [
        Contender("adaptive", None),
        Contender("oracle", None),
    ]
    for c, contender in enumerate(contenders):
        streams = [np.random.default_rng([seed, c, w]) for w in range(workers)]
        share = [batch // workers + (w < batch % workers) for w in range(workers)]
        pool = [_Worker() for _ in range(workers)]
        if contender.name == "adaptive":
            for w, worker in enumerate(pool):
                _choice(regime, arms, share[w], streams[w], worker)
        elif regime.padded:  # the other contenders' shapes are warmed up as calibration warms adaptive's
            widths = {1 + parse_strategy(a).max_draft_nodes for a in arms}
            for worker, n in zip(pool, share):
                worker.captured |= {graph_pad(m, t) for m in range(1, n + 1) for t in widths}
        for r, lengths in enumerate(rollouts):
            bounds = np.cumsum([0, *share])
            times = []
            for w, worker in enumerate(pool):
                part = lengths[bounds[w] : bounds[w + 1]]
                times.append(
                    _drain(regime.at_rollout(r), contender, worker, part, hazards, r * per_rollout, streams[w], max_new)
                )
            contender.seconds.append(max(times))
            if contender.name == "adaptive":  # the policy sync: the workers' books merge
                merged = AcceptanceBook.merged([w.choice.selector.acceptance.state_dict() for w in pool])
                for worker in pool:
                    worker.choice.selector.merge_acceptance(merged)
    return {c.name: c for c in contenders}


@dataclass(frozen=True)
class Verdict:
    """Adaptive against the others over one run."""

    regime: str
    seed: int
    best_fixed: str
    vs_best_fixed: float  # total time of the best fixed arm / adaptive's
    first_vs_best_fixed: float  # ... in the first rollout
    vs_oracle: float  # adaptive's total time / the oracle's
    off_first: (
        float  # share of adaptive's steps on an arm its point estimates ranked below the first, beyond their error
    )


def judge(results: dict[str, Contender], regime: str, seed: int) -> Verdict:
    fixed = {k: c for k, c in results.items() if c.arm is not None}
    best = min(fixed, key=lambda k: sum(fixed[k].seconds))
    adaptive, oracle = results["adaptive"], results["oracle"]
    return Verdict(
        regime,
        seed,
        best,
        sum(fixed[best].seconds) / sum(adaptive.seconds),
        fixed[best].seconds[0] / adaptive.seconds[0],
        sum(adaptive.seconds) / sum(oracle.seconds),
        adaptive.off_first / max(adaptive.steps, 1),
    )


def worst_case(regime: str, seeds: range = range(5), **kwargs) -> list[Verdict]:
    """The verdicts of ``seeds`` runs of ``regime`` (the targets hold on their minimum)."""
    return [judge(simulate(regime, seed, **kwargs), regime, seed) for seed in seeds]


__all__ = ["REGIMES", "Regime", "Verdict", "judge", "simulate", "worst_case"]
