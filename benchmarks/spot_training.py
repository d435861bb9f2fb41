"""Spot drafter training on idle Ray workers, on vs off, in a demo-sized GRPO run.

The same GRPO configuration (tiny chain-sum policy, shipped EAGLE-3 head, 2 Ray workers, same
seeds) runs twice in one process: once with the head trained on workers the long tail leaves
idle, once with the head frozen. Per RL step it records the mean accepted length, the rollout
time and the drafter steps taken in the tail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..demo import DemoConfig, run_demo_with_rollout
from .report import plot_panels

logger = logging.getLogger(__name__)


@dataclass
class SpotRun:
    name: str
    accept_length: list[float]  # per RL step
    rollout_s: list[float]
    spot_steps: list[int]
    drafter_version: list[int | None]


def measure_spot_training(steps: int, workers: int = 2, seed: int = 0, quick: bool = False) -> list[SpotRun]:
    base = DemoConfig().with_overrides(
        max_steps=steps,
        seed=seed,
        workers=workers,
        drafter_train_steps=0,
        wandb=False,
        strategy="chain:4",
        drafter="eagle3",
        output_dir="outputs/bench_spot",
        max_spot_steps=64,
    )
    if quick:
        base = base.with_overrides(prompts_per_step=2, num_generations=4, max_completion_length=96)
    runs = []
    for name, spot in (("spot training on", True), ("spot training off", False)):
        summary, rollout, _ = run_demo_with_rollout(base.with_overrides(spot_training=spot))
        history = rollout.history
        runs.append(
            SpotRun(
                name=name,
                accept_length=[h.mean_accept_length for h in history],
                rollout_s=[h.time_s for h in history],
                spot_steps=[h.spot_train_steps for h in history],
                drafter_version=[h.drafter_version for h in history],
            )
        )
        logger.info("%s: %s", name, summary)
    return runs


def spot_table(runs: list[SpotRun]) -> str:
    """Per RL step, the two runs side by side. Step 1's rollout time includes starting the workers."""
    on, off = runs
    lines = [
        "| RL step | accept length (on) | accept length (off) | rollout s (on) | rollout s (off) | "
        "drafter steps in the tail (on) | drafter version (on) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i in range(len(on.accept_length)):
        lines.append(
            f"| {i + 1} | {on.accept_length[i]:.2f} | {off.accept_length[i]:.2f} | {on.rollout_s[i]:.2f} | "
            f"{off.rollout_s[i]:.2f} | {on.spot_steps[i]} | {on.drafter_version[i]} |"
        )

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    later = slice(1, None)  # without the first step (worker start-up)
    lines.append(
        f"| mean (steps 2+) | {mean(on.accept_length[later]):.2f} | {mean(off.accept_length[later]):.2f} | "
        f"{mean(on.rollout_s[later]):.2f} | {mean(off.rollout_s[later]):.2f} | "
        f"{sum(on.spot_steps)} in all | |"
    )
    return "\n".join(lines)


def plot_spot(runs: list[SpotRun], path: Path) -> None:
    def steps(run: SpotRun) -> list[int]:
        return list(range(1, len(run.accept_length) + 1))

    plot_panels(
        path,
        [
            ("Acceptance over RL steps", "mean accepted length", [(r.name, steps(r), r.accept_length) for r in runs]),
            (
                "Rollout time per step (from step 2)",
                "rollout seconds",
                [(r.name, steps(r)[1:], r.rollout_s[1:]) for r in runs],
            ),
        ],
    )


def spot_section(runs: list[SpotRun], plot_name: str) -> str:
    return (
        "GRPO on the tiny chain-sum task with `SpecRollout(workers=2)` (local Ray, one CPU per worker), "
        "`chain:4` drafts from the shipped EAGLE-3 head, the same seeds in both runs. With spot training on, "
        "a worker whose shard has drained trains the head (chunks of 4 steps of 4 samples x 256 tokens, "
        "learning rate 1e-4, at most 64 per rollout) while the other is still generating; the newest head goes "
        "to both workers after each rollout. Step 1 includes starting Ray and the workers.\n\n"
        f"{spot_table(runs)}\n\n![spot training]({plot_name})"
    )
