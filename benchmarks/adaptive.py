"""Adaptive strategy selection on a long-tail rollout, against fixed strategies and HF generate.

One call generates all prompts at once (as one GRPO rollout does): the batch starts full and
drains into a long tail of a few long completions. Each contender runs the same prompts in the
same run: HF ``generate`` (batched, left-padded, as TRL does), the engine without speculation,
every fixed strategy, and ``adaptive`` twice (a cold selector, then the same engine again, as
the next RL step finds it). A uniform-length, large-batch workload checks that adaptive does not
cost anything where speculation cannot pay.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..rollout.engine import RolloutEngine, StepRecord
from ..rollout.params import RolloutConfig, SamplingParams
from ..rollout.strategy import parse_strategy
from .goodput import goodput_by_bucket
from .hf_baseline import hf_generate
from .report import pyplot, save_figure

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    name: str
    seconds: float
    tokens: int
    tail_s: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)  # the last pass's decode steps (the plot)
    strategy_steps: dict[str, int] = field(default_factory=dict)
    all_steps: list[StepRecord] = field(default_factory=list)  # every pass's decode steps
    pass_seconds: list[float] = field(default_factory=list)  # each pass's, in round order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _per_request(params: SamplingParams, n: int, workload: int) -> list[SamplingParams]:
    """Seeded per request: every contender's pass on ``workload`` samples the same completions
    with plain decoding, and with every strategy under position-keyed noise."""
    return [params.with_updates(seed=1000 * workload + i) for i in range(n)]


class _EngineContender:
    """One engine (one strategy) making passes over the same prompts; with ``split_cold`` its
    first pass (a fresh selector) is reported apart from the rest (what later RL steps see)."""

    def __init__(
        self, name, model, drafter, prompts, params, eos, strategy: str, split_cold: bool = False, max_num_seqs=256
    ):
        self.name, self.prompts, self.params, self.split_cold = name, prompts, params, split_cold
        parsed = parse_strategy(strategy)
        if not parsed.wants_model_drafter:
            drafter = None  # an attached EAGLE-3 head makes every forward tap features: not plain decoding
        config = RolloutConfig(strategy=strategy, max_num_seqs=max_num_seqs)
        self.engine = RolloutEngine(model, config, drafter=drafter, eos_token_ids=eos)
        self.engine.generate([list(p) for p in prompts[:2]], params.with_updates(max_new_tokens=8))  # warm-up

    def run_pass(self, workload: int) -> RunResult:
        engine = self.engine
        before_log, before_tail = len(engine.stats.step_log), engine.stats.tail_time_s
        before_steps = dict(engine.stats.strategy_steps)
        start = time.perf_counter()
        outs = engine.generate([list(p) for p in self.prompts], _per_request(self.params, len(self.prompts), workload))
        seconds = time.perf_counter() - start
        used = {k: v - before_steps.get(k, 0) for k, v in engine.stats.strategy_steps.items()}
        return RunResult(
            self.name,
            seconds,
            sum(len(o.completion_ids) for o in outs),
            engine.stats.tail_time_s - before_tail,
            list(engine.stats.step_log)[before_log:],
            {k: v for k, v in used.items() if v},
        )


class _HFContender:
    """HF ``generate`` on left-padded batches, as TRL calls it."""

    def __init__(self, model, prompts, params, eos, pad_token_id):
        params = params.with_updates(noise="stream", seed=None)  # HF draws from torch's global stream
        self.name, self.split_cold = "HF generate", False
        self.model, self.prompts, self.params, self.eos, self.pad = model, prompts, params, eos, pad_token_id
        hf_generate(model, [list(p) for p in prompts[:2]], params.with_updates(max_new_tokens=8), eos, pad_token_id)

    def run_pass(self, workload: int) -> RunResult:
        torch.manual_seed(workload)
        start = time.perf_counter()
        completions = hf_generate(self.model, [list(p) for p in self.prompts], self.params, self.eos, self.pad)
        return RunResult(self.name, time.perf_counter() - start, sum(len(c) for c in completions))


def _merge(label: str, group: list[RunResult]) -> RunResult:
    merged = RunResult(
        label,
        sum(p.seconds for p in group),
        sum(p.tokens for p in group),
        sum(p.tail_s for p in group),
        group[-1].steps,
        {k: sum(p.strategy_steps.get(k, 0) for p in group) for k in {k for p in group for k in p.strategy_steps}},
        [s for p in group for s in p.steps],
        [p.seconds for p in group],
    )
    logger.info("%s: %.2fs, %.0f tok/s", label, merged.seconds, merged.tokens_per_s)
    return merged


def _interleaved(contenders: list, repeats: int) -> list[RunResult]:
    """Each contender's ``repeats`` passes merged into one result, round by round: in round ``r``
    every contender runs workload ``r`` (the same prompts and seeds), so a shared machine's speed
    drift over minutes hits all of them alike and each round's passes can be compared pair by
    pair. The order rotates from round to round, so no contender always follows the same one,
    and the garbage a pass leaves is collected before the next starts (a slow host-heavy arm's
    garbage would otherwise be the next pass's collection). A ``split_cold`` contender first makes
    a cold pass (its fresh engine's first call, on a workload of its own, ``repeats``), reported
    apart: its later passes are what later RL steps see."""
    cold = {i: c.run_pass(repeats) for i, c in enumerate(contenders) if c.split_cold}
    done: list[list[RunResult]] = [[] for _ in contenders]
    for workload in range(repeats):
        shift = workload * len(contenders) // repeats
        for i in [*range(shift, len(contenders)), *range(shift)]:
            gc.collect()
            done[i].append(contenders[i].run_pass(workload))
    merged = []
    for i, (c, runs) in enumerate(zip(contenders, done)):
        groups = [(f"{c.name} (cold)", [cold[i]]), (f"{c.name} (warm)", runs)] if c.split_cold else [(c.name, runs)]
        merged += [_merge(label, group) for label, group in groups]
    return merged


def same_pass_ratios(results: Sequence[RunResult], name: str, against: str) -> list[float]:
    """Round by round, ``against``'s seconds over ``name``'s on the same workload (> 1: ``name``
    was faster), the median of which is what the guide asks for on a noisy machine."""
    by = {r.name: r for r in results}
    return [b / a for a, b in zip(by[name].pass_seconds, by[against].pass_seconds)]


def measure_long_tail(
    model,
    drafter,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos: list[int],
    pad_token_id: int,
    fixed: Sequence[str] = ("chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid"),
    repeats: int = 3,
) -> list[RunResult]:
    """Every contender makes ``repeats`` passes, interleaved round by round (:func:`_interleaved`);
    adaptive makes one more (its cold pass). With position-keyed noise every engine emits the same
    completions on a workload, so a round's passes differ only in how fast they decode them."""
    contenders = [_HFContender(model, prompts, params, eos, pad_token_id)]
    for strategy in ("none", *fixed):
        contenders.append(_EngineContender(strategy, model, drafter, prompts, params, eos, strategy))
    contenders.append(_EngineContender("adaptive", model, drafter, prompts, params, eos, "adaptive", split_cold=True))
    return _interleaved(contenders, repeats)


def measure_uniform(model, drafter, prompts, params: SamplingParams, eos: list[int], repeats: int = 3):
    """Every request runs exactly ``max_new_tokens`` (EOS ignored): a full batch all the way."""
    uniform = params.with_updates(ignore_eos=True)
    contenders = [
        _EngineContender("none", model, drafter, prompts, uniform, eos, "none"),
        _EngineContender("adaptive", model, drafter, prompts, uniform, eos, "adaptive", split_cold=True),
    ]
    return _interleaved(contenders, repeats)


def long_tail_table(results: Sequence[RunResult]) -> str:
    by = {r.name: r for r in results}
    none = by["none"].tokens_per_s
    hf = by["HF generate"].tokens_per_s if "HF generate" in by else None
    fixed = [r for r in results if r.name not in ("HF generate", "none") and not r.name.startswith("adaptive")]
    best_fixed = max(fixed, key=lambda r: r.tokens_per_s) if fixed else None
    lines = [
        "| run | tokens | total s | tok/s | vs none | vs HF generate | tail s | strategies used (steps) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        vs_hf = f"{r.tokens_per_s / hf:.2f}x" if hf else "n/a"
        mark = " (best fixed)" if r is best_fixed else ""
        used = ", ".join(f"`{k}` {v}" for k, v in sorted(r.strategy_steps.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r.name}{mark} | {r.tokens:,} | {r.seconds:.2f} | {r.tokens_per_s:,.0f} | "
            f"{r.tokens_per_s / none:.2f}x | {vs_hf} | {r.tail_s:.2f} | {used} |"
        )
    return "\n".join(lines)


def same_pass_table(results: Sequence[RunResult]) -> str:
    """Each fixed arm's seconds over ``adaptive (warm)``'s, round by round: median and spread."""
    engines = [r for r in results if r.name not in ("HF generate", "none") and not r.name.startswith("adaptive")]
    best = max(engines, key=lambda r: r.tokens_per_s)
    lines = ["| against | rounds | median | spread |", "|---|---:|---:|---|"]
    for r in engines:
        ratios = same_pass_ratios(results, "adaptive (warm)", r.name)
        mark = " (best fixed)" if r is best else ""
        lines.append(
            f"| {r.name}{mark} | {len(ratios)} | {statistics.median(ratios):.2f}x | "
            f"{min(ratios):.2f}-{max(ratios):.2f} |"
        )
    return "\n".join(lines)


@dataclass
class OracleBound:
    """What the best *fixed* arm per bucket would give: no selector can beat its arms' goodputs."""

    table: str
    none_decode_s: float  # the no-speculation run's decode time
    oracle_decode_s: float  # the same tokens per bucket, each bucket at its best measured goodput

    @property
    def speedup(self) -> float:
        return self.none_decode_s / self.oracle_decode_s if self.oracle_decode_s else 0.0


def oracle_bound(results: Sequence[RunResult], bounds: Sequence[int], min_steps: int = 5) -> OracleBound:
    """Per-bucket goodput of every fixed strategy (and of adaptive, for comparison) and the bound
    it implies: the no-speculation run's tokens in each bucket, decoded at that bucket's best fixed
    goodput (arms with fewer than ``min_steps`` steps in a bucket are not trusted there)."""
    runs = {r.name: goodput_by_bucket(r.all_steps, bounds) for r in results if r.all_steps}
    fixed = [n for n in runs if not n.startswith("adaptive")]
    adaptive = [n for n in runs if n.startswith("adaptive")]
    none = runs["none"]
    header = " | ".join(f"`{n}` tok/s" for n in fixed + adaptive)
    chooser = adaptive[-1] if adaptive else "adaptive"
    lines = [
        f"| active sequences | `none` decode s | {header} | best fixed | `{chooser}` arms (steps) |",
        "|---|---:|" + "---:|" * (len(fixed) + len(adaptive)) + "---|---|",
    ]
    none_s = oracle_s = 0.0
    previous = 0
    for bound in bounds:
        if bound not in none:
            previous = bound
            continue
        trusted = {n: runs[n][bound].goodput for n in fixed if bound in runs[n] and runs[n][bound].steps >= min_steps}
        best = max(trusted, key=trusted.get)
        none_s += none[bound].seconds
        # min(): the best arm is at least as fast as none, but tokens / (tokens / s) may round above s
        oracle_s += min(none[bound].seconds, none[bound].tokens / trusted[best])
        cells = []
        for n in fixed + adaptive:
            g = runs[n].get(bound)
            cells.append(f"{g.goodput:,.0f}" if g and g.steps else "-")
        used = runs[adaptive[-1]].get(bound) if adaptive else None
        arms = ", ".join(f"`{a}` {k}" for a, k in sorted(used.arms.items(), key=lambda kv: -kv[1])) if used else ""
        label = f"{previous + 1}-{bound}" if bound > previous + 1 else str(bound)
        if bound == bounds[-1]:
            label = f">{previous}"
        lines.append(f"| {label} | {none[bound].seconds:.2f} | {' | '.join(cells)} | `{best}` | {arms} |")
        previous = bound
    return OracleBound("\n".join(lines), none_s, oracle_s)


def bucket_weighted(results: Sequence[RunResult], bounds: Sequence[int]) -> dict[str, float]:
    """Each engine run's decode seconds for the no-speculation run's tokens of every bucket at the
    run's own goodput there (a bucket the run never reached counts at ``none``'s time).

    At T > 0 speculative sampling draws other completions than plain decoding (equally likely,
    not the same), so each run gets its own long tail; a pass's total time leans on how long its
    longest completions happened to be. Weighting every run by the same tokens per bucket removes
    that luck from the comparison."""
    runs = {r.name: goodput_by_bucket(r.all_steps, bounds) for r in results if r.all_steps}
    none = runs["none"]
    out = {}
    for name, buckets in runs.items():
        out[name] = sum(
            nb.tokens / buckets[b].goodput if b in buckets and buckets[b].goodput else nb.seconds
            for b, nb in none.items()
        )
    return out


def plot_adaptive(result: RunResult, path: Path) -> None:
    """Active sequences per decode step, coloured by the strategy the selector chose."""
    plt = pyplot()

    names = sorted({s.strategy for s in result.steps})
    colours = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(9, 3.6))
    elapsed, t = [], 0.0
    for s in result.steps:
        elapsed.append(t)
        t += s.seconds
    for n in names:
        xs = [e for e, s in zip(elapsed, result.steps) if s.strategy == n]
        ys = [s.num_active for s in result.steps if s.strategy == n]
        ax.scatter(xs, ys, s=6, color=colours[n], label=n)
    ax.set_xlabel("seconds into the rollout (decode steps)")
    ax.set_ylabel("active sequences")
    ax.set_title(f"{result.name}: strategy chosen per step")
    ax.legend(markerscale=3, fontsize=8)
    save_figure(fig, path)
