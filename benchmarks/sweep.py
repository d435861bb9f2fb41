"""Speculative arms against plain decoding at fixed batch sizes, measured as ratios that survive a noisy machine.

Every contender (an engine with one strategy and drafter) is built once per batch size and makes
``passes`` passes over the same prompts; pass p of every contender runs before pass p + 1 of any,
in an order rotated per pass, so a shared machine's speed drift hits all of them alike. A
contender's speed relative to ``none`` is the median over passes of the same-pass ratio, with
the smallest and largest as its spread. Each speculative step's time is split into drafting, the
target's verification forward, and everything else (sampling, acceptance, KV bookkeeping).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..progress import progress_bar
from ..rollout.engine import RolloutEngine
from ..rollout.params import RolloutConfig, SamplingParams
from .report import pyplot, save_figure

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arm:
    """A contender: a strategy and the drafter (by name in the sweep's drafters) it drafts with."""

    label: str
    strategy: str
    drafter: str | None = None


@dataclass
class PassResult:
    tokens: int
    seconds: float
    decode_steps: int
    decode_s: float
    draft_s: float
    decode_model_s: float
    spec_seq_steps: int
    spec_emitted: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class SweepCell:
    """One arm at one batch size: its passes and their same-pass ratios to ``none``."""

    arm: Arm
    batch_size: int
    passes: list[PassResult] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)

    def _sum(self, name: str) -> float:
        return sum(getattr(p, name) for p in self.passes)

    @property
    def tokens_per_s(self) -> float:
        return self._sum("tokens") / self._sum("seconds")

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else 1.0

    @property
    def accept_length(self) -> float:
        steps = self._sum("spec_seq_steps")
        return self._sum("spec_emitted") / steps if steps else 1.0

    def step_split_ms(self) -> tuple[float, float, float, float]:
        """Per decode step: total, drafting, target forward, the rest (milliseconds)."""
        steps = self._sum("decode_steps")
        total, draft, model = self._sum("decode_s"), self._sum("draft_s"), self._sum("decode_model_s")
        return tuple(1000 * x / steps for x in (total, draft, model, total - draft - model))  # type: ignore[return-value]


def _run_pass(engine: RolloutEngine, batches: list[list[list[int]]], params: list[list[SamplingParams]]) -> PassResult:
    before = engine.stats.as_dict()
    tokens, start = 0, time.perf_counter()
    for batch, batch_params in zip(batches, params):
        tokens += sum(len(o.completion_ids) for o in engine.generate(batch, batch_params))
    seconds = time.perf_counter() - start
    now = engine.stats.as_dict()

    def delta(key: str) -> float:
        return now[key] - before[key]

    return PassResult(
        tokens,
        seconds,
        int(delta("decode_steps")),
        delta("decode_time_s"),
        delta("draft_time_s"),
        delta("decode_model_time_s"),
        int(delta("spec_seq_steps")),
        int(delta("spec_emitted_tokens")),
    )


def measure_sweep(
    model: torch.nn.Module,
    drafters: dict[str, object],
    arms: Sequence[Arm],
    prompts: Sequence[Sequence[int]],
    warmup_prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    batch_sizes: Sequence[int],
    prompts_per_size: dict[int, int],
    eos_token_ids: Sequence[int],
    passes: int = 3,
) -> list[SweepCell]:
    """Every arm at every batch size, ``passes`` interleaved passes each (see the module docstring).
    ``arms`` must include ``none``. Requests are seeded per pass and prompt, so the plain passes
    of different runs sample the same completions."""
    if not any(a.strategy == "none" for a in arms):
        raise ValueError("arms must include a 'none' arm (the baseline of every ratio)")
    cells: list[SweepCell] = []
    for bs in batch_sizes:
        n = prompts_per_size.get(bs, bs)
        chosen = [list(prompts[i % len(prompts)]) for i in range(n)]
        batches = [chosen[i : i + bs] for i in range(0, n, bs)]
        engines = []
        for arm in arms:
            drafter = drafters[arm.drafter] if arm.drafter else None
            engine = RolloutEngine(
                model, RolloutConfig(strategy=arm.strategy), drafter=drafter, eos_token_ids=eos_token_ids
            )
            engine.generate([list(p) for p in warmup_prompts], params.with_updates(max_new_tokens=16))
            engines.append(engine)
        row = [SweepCell(arm, bs) for arm in arms]
        for p in progress_bar(range(passes), desc=f"sweep batch {bs}", unit="pass"):
            request_params = [params.with_updates(seed=10_000 * p + i) for i in range(n)]  # one seed per prompt
            seeded = [request_params[i : i + bs] for i in range(0, n, bs)]
            order = list(range(len(arms)))
            order = order[p % len(order) :] + order[: p % len(order)]
            for i in order:
                row[i].passes.append(_run_pass(engines[i], batches, seeded))
            base = next(c for c in row if c.arm.strategy == "none").passes[-1].tokens_per_s
            for c in row:
                c.ratios.append(c.passes[-1].tokens_per_s / base)
        for c in row:
            logger.info(
                "batch %d %s: %.0f tok/s, %.2fx none, accept %.2f",
                bs,
                c.arm.label,
                c.tokens_per_s,
                c.ratio,
                c.accept_length,
            )
        cells += row
    return cells


def sweep_table(cells: Sequence[SweepCell]) -> str:
    lines = [
        "| batch | arm | tok/s | vs none (median, spread) | accept length | step ms | draft ms | target forward ms "
        "| rest ms |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        total, draft, model, rest = c.step_split_ms()
        spread = f"{c.ratio:.2f}x ({min(c.ratios):.2f}-{max(c.ratios):.2f})"
        lines.append(
            f"| {c.batch_size} | {c.arm.label} | {c.tokens_per_s:,.0f} | {spread} | {c.accept_length:.2f} | "
            f"{total:.2f} | {draft:.2f} | {model:.2f} | {rest:.2f} |"
        )
    return "\n".join(lines)


def best_ratio(cells: Sequence[SweepCell], batch_size: int, drafter: str | None) -> SweepCell | None:
    """The fastest speculative arm drafting with ``drafter`` at ``batch_size``."""
    pool = [c for c in cells if c.batch_size == batch_size and c.arm.drafter == drafter and c.arm.strategy != "none"]
    return max(pool, key=lambda c: c.ratio) if pool else None


def plot_sweep(cells: Sequence[SweepCell], path) -> None:
    """Speed relative to ``none`` per batch size, one line per arm, with the pass spread."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = list(dict.fromkeys(c.arm.label for c in cells))
    for label in labels:
        mine = [c for c in cells if c.arm.label == label]
        xs = [c.batch_size for c in mine]
        ys = [c.ratio for c in mine]
        lo = [c.ratio - min(c.ratios) for c in mine]
        hi = [max(c.ratios) - c.ratio for c in mine]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s vs none")
    ax.legend(fontsize=7)
    save_figure(fig, path)
