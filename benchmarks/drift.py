"""Does the drafter keep up with a moving policy? GRPO on the deep policy with the EAGLE-3 head,
five arms with the same seeds: the head frozen, trained by spot training on idle Ray workers,
trained from the trainer's own loss forwards (``DrafterFromTrainer``), both, and no head at all but
the policy's own first layers (a self-speculative drafter, which moves with the policy). Per RL step: the
mean accept length of the rollout, its time, and how far the policy has moved (the share of probe
prompts whose greedy completion differs from the starting policy's, and the share of their
tokens that differ).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..demo import DemoConfig, run_demo_with_rollout
from ..rollout import RolloutConfig, RolloutEngine, SamplingParams
from ..rollout.admission import eos_ids_of
from .policies import task_prompts
from .report import plot_panels

logger = logging.getLogger(__name__)

ARMS = {
    "frozen": dict(spot_training=False, drafter_from_trainer=0),
    "spot training": dict(spot_training=True, drafter_from_trainer=0),
    "DrafterFromTrainer": dict(spot_training=False, drafter_from_trainer=4),
    "both": dict(spot_training=True, drafter_from_trainer=4),
    # the policy's own first layers (7 of the deep policy's 24: where its early exit first agrees 70%)
    "self-speculative": dict(spot_training=False, drafter_from_trainer=0, drafter="self:{layers}"),
}


@dataclass
class DriftBenchConfig:
    policy: str = "deep"
    steps: int = 30
    learning_rate: float = 5e-4  # 25x the demo's, so that the policy moves within the run (1e-4 moved it little)
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = 256
    probes: int = 8
    probe_tokens: int = 48
    arms: tuple[str, ...] = tuple(ARMS)
    seed: int = 0

    @classmethod
    def quick(cls) -> DriftBenchConfig:
        return cls(policy="tiny", steps=2, prompts_per_step=2, num_generations=4, max_completion_length=48, probes=2)


@dataclass
class DriftRun:
    arm: str
    accept_length: list[float]
    rollout_s: list[float]
    tokens: list[int]
    spot_steps: list[int]
    greedy_changed: list[float] = field(default_factory=list)  # share of probes, per step
    tokens_changed: list[float] = field(default_factory=list)  # share of probe tokens, per step


class PolicyDrift(TrainerCallback):
    """Greedy completions of fixed probe prompts after every optimizer step, against the starting
    policy's: how far RL has moved the policy."""

    def __init__(self, prompts: list[list[int]], eos: list[int], max_new_tokens: int) -> None:
        self.prompts, self.eos, self.max_new_tokens = prompts, eos, max_new_tokens
        self.start: list[list[int]] | None = None
        self.greedy_changed: list[float] = []
        self.tokens_changed: list[float] = []

    def _greedy(self, model) -> list[list[int]]:
        engine = RolloutEngine(model, RolloutConfig(kv_cache_tokens=8192), eos_token_ids=self.eos)
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
        return [o.completion_ids for o in engine.generate(self.prompts, params)]

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start = self._greedy(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = self._greedy(model)
        self.greedy_changed.append(sum(a != b for a, b in zip(now, self.start)) / len(now))
        differ = total = 0
        for a, b in zip(now, self.start):
            n = max(len(a), len(b))
            differ += sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
            total += n
        self.tokens_changed.append(differ / max(total, 1))


def measure_drift(cfg: DriftBenchConfig) -> list[DriftRun]:
    from ..tasks.sft import load_shipped

    model, tokenizer = load_shipped(cfg.policy, "policy")
    probes = [list(p) for p in task_prompts(tokenizer, cfg.probes, seed=cfg.seed + 4242)]
    eos = sorted(eos_ids_of(model, tokenizer))
    self_layers = max(1, model.config.num_hidden_layers * 7 // 24)
    del model
    base = DemoConfig(
        policy=cfg.policy,
        max_steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step,
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        learning_rate=cfg.learning_rate,
        seed=cfg.seed,
        strategy="chain:4",
        drafter="eagle3",
        workers=2,
        wandb=False,
        warmup_steps=0,
        baseline=False,
        export=None,
        output_dir="outputs/bench_drift",
    )
    runs = []
    for arm in cfg.arms:
        drift = PolicyDrift(probes, eos, cfg.probe_tokens)
        with torch.random.fork_rng():
            settings = {k: v.format(layers=self_layers) if k == "drafter" else v for k, v in ARMS[arm].items()}
            _, rollout = run_demo_with_rollout(dataclasses.replace(base, **settings), callbacks=[drift])
        history = rollout.history
        runs.append(
            DriftRun(
                arm,
                [h.mean_accept_length for h in history],
                [h.time_s for h in history],
                [h.completion_tokens for h in history],
                [h.spot_train_steps for h in history],
                drift.greedy_changed,
                drift.tokens_changed,
            )
        )
        logger.info("drift arm %s: accept %s", arm, runs[-1].accept_length)
    return runs


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def drift_table(runs: list[DriftRun]) -> str:
    """Per arm: accept length at the start (steps 1-3) and the end (last 3), their ratio, the
    rollout seconds per 1000 tokens (from step 2: step 1 starts the workers) and the policy's move."""
    frozen = next((r for r in runs if r.arm == "frozen"), None)
    lines = [
        "| arm | accept length, steps 1-3 | last 3 steps | end / start | rollout s per 1k tokens (vs frozen) | "
        "drafter steps in the tail | probes with other greedy output at the end | probe tokens changed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def per_k(run: DriftRun) -> float:
        return 1000 * sum(run.rollout_s[1:]) / max(sum(run.tokens[1:]), 1)

    for r in runs:
        start, end = _mean(r.accept_length[:3]), _mean(r.accept_length[-3:])
        vs = f" ({per_k(r) / per_k(frozen):.2f}x)" if frozen is not None else ""
        lines.append(
            f"| {r.arm} | {start:.2f} | {end:.2f} | {end / start:.2f} | {per_k(r):.2f}{vs} | {sum(r.spot_steps)} | "
            f"{r.greedy_changed[-1] if r.greedy_changed else float('nan'):.0%} | "
            f"{r.tokens_changed[-1] if r.tokens_changed else float('nan'):.0%} |"
        )
    return "\n".join(lines)


def plot_drift(runs: list[DriftRun], path: Path) -> None:
    steps = lambda r: list(range(1, len(r.accept_length) + 1))  # noqa: E731
    plot_panels(
        path,
        [
            ("Accept length per RL step", "mean accepted length", [(r.arm, steps(r), r.accept_length) for r in runs]),
            (
                "How far the policy moved",
                "probe tokens changed vs step 0",
                [(r.arm, steps(r)[: len(r.tokens_changed)], r.tokens_changed) for r in runs],
            ),
        ],
    )


def drift_section(runs: list[DriftRun], cfg: DriftBenchConfig, plot_name: str) -> str:
    return (
        f"GRPO on the shipped {cfg.policy} policy for {cfg.steps} RL steps ({cfg.prompts_per_step} sampled "
        f"chain-sum prompts x {cfg.num_generations} samples per step, learning rate {cfg.learning_rate:g}, "
        f"at most {cfg.max_completion_length} tokens), 2 Ray workers, `chain:4` drafts from the shipped "
        "EAGLE-3 head, the same seeds in every arm: the head *frozen*; trained by *spot training* on "
        "workers idle in the tail; trained by *DrafterFromTrainer* on the trainer's loss forwards (4 steps "
        "after every optimizer step, published to the workers); *both*; and *self-speculative*: no head, the "
        "policy's own first layers (7 of 24 on the deep policy; its final norm and LM head, no adapter) as "
        "the drafter, which moves with the policy and is never trained (Mirror-SD issue, item 5). "
        "The policy's move: the greedy "
        f"completions of {cfg.probes} held-out probe prompts ({cfg.probe_tokens} tokens) after each step against "
        "the starting policy's. The format-shift part of this benchmark is not built yet.\n\n"
        f"{drift_table(runs)}\n\n![drift]({plot_name})"
    )
