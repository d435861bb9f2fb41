"""The rollout on the GRPO path, per RL step: fixed strategies against ``adaptive``.

Each contender is a ``SpecRollout`` built as the demo builds it (``demo._make_rollout``: the
demo's policy and drafter, in-process or on Ray workers) and called as TRL calls it, with the
demo's prompts, a stub trainer (tokenizer, seed, global step, metrics) and position-keyed
sampling, so every contender emits the same completions and a ratio of tokens/s is a ratio of
times. Between RL steps the policy moves (``x (1 + perturb * noise)``, as an optimizer step does)
and every contender syncs it. Contenders are interleaved within each step, their order rotated
from step to step; the figure is the median of the same-step ratios to ``none`` and their spread.
"""

from __future__ import annotations

import gc
import logging
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from .policies import torch_threads
from .report import plot_panels

logger = logging.getLogger(__name__)

GRPO_PATH_TITLE = "Adaptive on the GRPO path: per RL step, in-process and on Ray workers"


@dataclass
class GRPOPathConfig:
    policy: str = "deep"
    drafter: str = "small_lm"
    strategies: tuple[str, ...] = ("none", "chain:4", "tree:4,2,8", "adaptive")
    workers: tuple[int, ...] = (0, 2)
    steps: int = 6
    num_generations: int = 8
    max_completion_length: int = 384
    perturb: float = 1e-3  # relative size of the policy's move between RL steps
    seed: int = 0

    def __post_init__(self) -> None:
        if "none" not in self.strategies:
            raise ValueError("GRPOPathConfig.strategies must contain 'none' (the reference)")
        if self.steps < 2:
            raise ValueError(f"GRPOPathConfig.steps must be an int >= 2, got {self.steps}")


@dataclass
class PathRun:
    """One contender in one placement: per RL step, its rollout's numbers."""

    strategy: str
    workers: int
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    accept_length: list[float] = field(default_factory=list)
    strategy_steps: list[dict[str, int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds)]


def _problems() -> list[str]:
    """The demo's fixed problem set (configs/demo_cpu.yaml)."""
    from ..demo import DemoConfig

    return DemoConfig.from_yaml(Path(__file__).resolve().parent.parent / "configs" / "demo_cpu.yaml").problems


def _stub_trainer(policy, tokenizer, seed: int) -> SimpleNamespace:
    """What ``SpecRollout`` reads from a ``GRPOTrainer``."""
    return SimpleNamespace(
        args=SimpleNamespace(seed=seed),
        processing_class=tokenizer,
        model=policy,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        state=SimpleNamespace(global_step=0),
    )


def measure_grpo_path(cfg: GRPOPathConfig) -> list[PathRun]:
    from ..demo import DemoConfig, _make_rollout
    from ..tasks.sft import load_shipped

    runs: list[PathRun] = []
    for workers in cfg.workers:
        policy, tokenizer = load_shipped(cfg.policy, "policy")
        contenders = {}
        for strategy in cfg.strategies:
            demo_cfg = DemoConfig().with_overrides(
                policy=cfg.policy,
                strategy=strategy,
                drafter=cfg.drafter,
                workers=workers,
                spot_training=False,
                position_noise=True,
                seed=cfg.seed,
                drafter_train_steps=0,
                # a contender's workers idle while another's run: no cores reserved for them
                num_cpus_per_worker=0.0,
            )
            rollout = _make_rollout(demo_cfg)
            contenders[strategy] = rollout
        runs.extend(run_path(contenders, policy, tokenizer, cfg, workers))
        # the in-process contenders' engines (a KV cache each, held in reference cycles) are freed
        # before the next placement's workers start: left to the collector, the driver held 7.3 GB
        # beside the deep policy's 8 Ray workers (about 2.2 GB each), past a 24 GiB machine
        del contenders
        gc.collect()
    return runs


def run_path(contenders: dict, policy, tokenizer, cfg: GRPOPathConfig, workers: int) -> list[PathRun]:
    """``cfg.steps`` RL steps of the contenders (strategy -> ``SpecRollout``) on ``policy``: each step
    the policy moves, then every contender rolls out the demo's prompts, in a rotated order; the
    contenders' Ray workers are shut down at the end."""
    from ..rollout import SamplingParams

    prompts = [[{"role": "user", "content": p}] for p in _problems() for _ in range(cfg.num_generations)]
    trainer = _stub_trainer(policy, tokenizer, cfg.seed)
    runs = {strategy: PathRun(strategy, workers) for strategy in contenders}
    for rollout in contenders.values():
        rollout.model = policy
        rollout.sampling = SamplingParams(temperature=1.0, max_new_tokens=cfg.max_completion_length)
    g = torch.Generator().manual_seed(cfg.seed)
    try:
        for step in range(cfg.steps):
            trainer.state.global_step = step
            if step:
                with torch.no_grad():
                    for p in policy.parameters():
                        p.mul_(1 + cfg.perturb * torch.randn(p.shape, generator=g))
            order = list(contenders)
            order = order[step % len(order) :] + order[: step % len(order)]
            for strategy in order:
                contenders[strategy](prompts, trainer)
                stats, run = contenders[strategy].last_stats, runs[strategy]
                run.seconds.append(stats.time_s)
                run.tokens.append(stats.completion_tokens)
                run.accept_length.append(stats.mean_accept_length)
                run.strategy_steps.append(dict(stats.strategy_steps))
            logger.info(
                "grpo path, workers %d, step %d: %s",
                workers,
                step + 1,
                {s: f"{r.tokens_per_s[-1]:.0f} tok/s" for s, r in runs.items()},
            )
    finally:
        for rollout in contenders.values():
            if rollout.coordinator is not None:
                rollout.coordinator.shutdown()
    return list(runs.values())


def _ratios(run: PathRun, none: PathRun) -> list[float]:
    return [a / b for a, b in zip(run.tokens_per_s, none.tokens_per_s)]


def _median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def grpo_path_table(runs: list[PathRun]) -> str:
    """Per placement and strategy: tokens/s relative to ``none`` from the second RL step (median
    of the same-step ratios, spread), ``adaptive`` against the best fixed arm of each step, and
    the accept length first step -> last."""
    lines = [
        "| placement | strategy | vs `none`, steps 2+ (median, spread) | vs best fixed arm, steps 2+ "
        "| accept length, step 1 -> last |",
        "|---|---|---:|---:|---|",
    ]
    for workers in sorted({r.workers for r in runs}):
        group = {r.strategy: r for r in runs if r.workers == workers}
        none = group["none"]
        fixed = [r for s, r in group.items() if s not in ("none", "adaptive")]
        for strategy, run in group.items():
            if strategy == "none":
                continue
            ratios = _ratios(run, none)[1:]
            vs_best = "-"
            if strategy == "adaptive" and fixed:
                best = [max(f.tokens_per_s[i] for f in fixed) for i in range(len(run.tokens_per_s))]
                vs_best = _median_spread([a / b for a, b in zip(run.tokens_per_s[1:], best[1:])])
            place = "in-process" if not workers else f"{workers} Ray workers"
            lines.append(
                f"| {place} | `{strategy}` | {_median_spread(ratios)} | {vs_best} | "
                f"{run.accept_length[0]:.2f} -> {run.accept_length[-1]:.2f} |"
            )
    return "\n".join(lines)


def grpo_path_steps(runs: list[PathRun]) -> str:
    """Per RL step: each strategy's ratio to ``none`` and ``adaptive``'s mix."""
    from ..demo import strategy_mix

    out = []
    for workers in sorted({r.workers for r in runs}):
        group = {r.strategy: r for r in runs if r.workers == workers}
        none, shown = group["none"], [s for s in group if s != "none"]
        out.append(f"{'In-process' if not workers else f'On {workers} Ray workers'}, tokens/s relative to `none`:\n")
        out.append("| RL step | `none` tok/s | " + " | ".join(f"`{s}`" for s in shown) + " | `adaptive` mix |")
        out.append("|---:|---:|" + "---:|" * len(shown) + "---|")
        for i, base in enumerate(none.tokens_per_s):
            cells = " | ".join(f"{group[s].tokens_per_s[i] / base:.2f}x" for s in shown)
            mix = strategy_mix(group["adaptive"].strategy_steps[i]) if "adaptive" in group else "-"
            out.append(f"| {i + 1} | {base:.0f} | {cells} | {mix} |")
        out.append("")
    return "\n".join(out)


def plot_grpo_path(runs: list[PathRun], path: Path) -> None:
    panels = []
    for workers in sorted({r.workers for r in runs}):
        group = {r.strategy: r for r in runs if r.workers == workers}
        none = group["none"]
        series = [(s, list(range(1, len(r.seconds) + 1)), _ratios(r, none)) for s, r in group.items() if s != "none"]
        panels.append((f"{'in-process' if not workers else f'{workers} Ray workers'}", "tokens/s vs none", series))
    plot_panels(path, panels)


def grpo_path_section(runs: list[PathRun], cfg: GRPOPathConfig, plot_name: str) -> str:
    return (
        f"The demo's rollout as TRL calls it (`SpecRollout` from `demo._make_rollout`, the `{cfg.policy}` "
        f"policy and its `{cfg.drafter}` drafter, {cfg.steps} RL steps of the demo's "
        f"{len(_problems())} problems x {cfg.num_generations}, up to {cfg.max_completion_length} tokens, T = 1 with "
        "position-keyed noise, so every strategy emits the same completions). Between steps the policy "
        f"moves by x(1 + {cfg.perturb:g} noise) and is synced. Contenders interleaved within each step, "
        "their order rotated; ratios are same-step ratios to `none`. Step 1 includes each engine's "
        "first call (graph-free CPU: loading, the selector's first measurements).\n\n"
        f"{grpo_path_table(runs)}\n\n{grpo_path_steps(runs)}\n![per RL step]({plot_name})\n"
    )


def run_grpo_path_section(out: Path, quick: bool = False, policy: str = "deep") -> str:
    from .report import replace_section

    cfg = GRPOPathConfig(policy=policy, steps=2 if quick else 6, workers=(0,) if quick else (0, 2))
    plot_name = f"bench_grpo_path_{policy}.png"
    command = f"tailspec bench --section grpo_path --policy {policy}" + (" --quick" if quick else "")
    title = GRPO_PATH_TITLE + ("" if policy == "deep" else f": {policy} policy")
    with torch_threads(1):  # the section's machine line then names the threads it was measured with
        runs = measure_grpo_path(cfg)
        plot_grpo_path(runs, out.parent / plot_name)
        replace_section(out, title, grpo_path_section(runs, cfg, plot_name), command)
    return grpo_path_table(runs)
