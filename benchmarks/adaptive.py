"""Adaptive strategy selection on a long-tail rollout, against fixed strategies and HF generate.

One call generates all prompts at once (as one GRPO rollout does): the batch starts full and
drains into a long tail of a few long completions. Each contender runs the same prompts in the
same run: HF ``generate`` (batched, left-padded, as TRL does), the engine without speculation,
every fixed strategy, and ``adaptive`` twice (a cold selector, then the same engine again, as
the next RL step finds it). A uniform-length, large-batch workload checks that adaptive does not
cost anything where speculation cannot pay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..rollout.engine import RolloutEngine, StepRecord
from ..rollout.params import RolloutConfig, SamplingParams
from .hf_baseline import hf_generate

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    name: str
    seconds: float
    tokens: int
    tail_s: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    strategy_steps: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _engine_run(
    name: str, model, drafter, prompts, params, eos, strategy: str, repeats: int = 1, config: dict | None = None
) -> list[RunResult]:
    engine = RolloutEngine(
        model, RolloutConfig(strategy=strategy, **(config or {})), drafter=drafter, eos_token_ids=eos
    )
    engine.generate([list(p) for p in prompts[:2]], params.with_updates(max_new_tokens=8))  # warm-up
    out = []
    for r in range(repeats):
        before_log, before_tail = len(engine.stats.step_log), engine.stats.tail_time_s
        before_steps = dict(engine.stats.strategy_steps)
        torch.manual_seed(r)
        start = time.perf_counter()
        outs = engine.generate([list(p) for p in prompts], params)
        seconds = time.perf_counter() - start
        steps = list(engine.stats.step_log)[before_log:]
        used = {k: v - before_steps.get(k, 0) for k, v in engine.stats.strategy_steps.items()}
        label = name if repeats == 1 else f"{name} ({'cold' if r == 0 else 'warm'})"
        out.append(
            RunResult(
                label,
                seconds,
                sum(len(o.completion_ids) for o in outs),
                engine.stats.tail_time_s - before_tail,
                steps,
                {k: v for k, v in used.items() if v},
            )
        )
        logger.info("%s: %.2fs, %.0f tok/s", label, seconds, out[-1].tokens_per_s)
    return out


def measure_long_tail(
    model,
    drafter,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos: list[int],
    pad_token_id: int,
    fixed: Sequence[str] = ("chain:2", "chain:4", "tree:4,2,8", "suffix", "hybrid"),
) -> list[RunResult]:
    results = []
    hf_generate(model, [list(p) for p in prompts[:2]], params.with_updates(max_new_tokens=8), eos, pad_token_id)
    torch.manual_seed(0)
    start = time.perf_counter()
    completions = hf_generate(model, [list(p) for p in prompts], params, eos, pad_token_id)
    results.append(RunResult("HF generate", time.perf_counter() - start, sum(len(c) for c in completions)))
    results += _engine_run("none", model, drafter, prompts, params, eos, "none")
    for strategy in fixed:
        results += _engine_run(strategy, model, drafter, prompts, params, eos, strategy)
    results += _engine_run("adaptive", model, drafter, prompts, params, eos, "adaptive", repeats=2)
    return results


def measure_uniform(model, drafter, prompts, params: SamplingParams, eos: list[int]) -> list[RunResult]:
    """Every request runs exactly ``max_new_tokens`` (EOS ignored): a full batch all the way."""
    uniform = params.with_updates(ignore_eos=True)
    results = _engine_run("none", model, drafter, prompts, uniform, eos, "none")
    results += _engine_run("adaptive", model, drafter, prompts, uniform, eos, "adaptive", repeats=2)
    return results


def long_tail_table(results: Sequence[RunResult]) -> str:
    by = {r.name: r for r in results}
    none, hf = by["none"].seconds, by["HF generate"].seconds if "HF generate" in by else None
    fixed = [r for r in results if r.name not in ("HF generate", "none") and not r.name.startswith("adaptive")]
    best_fixed = min(fixed, key=lambda r: r.seconds) if fixed else None
    lines = [
        "| run | total s | tok/s | vs none | vs HF generate | tail s | strategies used (steps) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        vs_hf = f"{hf / r.seconds:.2f}x" if hf else "n/a"
        mark = " (best fixed)" if r is best_fixed else ""
        used = ", ".join(f"`{k}` {v}" for k, v in sorted(r.strategy_steps.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r.name}{mark} | {r.seconds:.2f} | {r.tokens_per_s:,.0f} | {none / r.seconds:.2f}x | {vs_hf} | "
            f"{r.tail_s:.2f} | {used} |"
        )
    return "\n".join(lines)


def plot_adaptive(result: RunResult, path: Path) -> None:
    """Active sequences per decode step, coloured by the strategy the selector chose."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
