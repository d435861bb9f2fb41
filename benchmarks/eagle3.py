"""EAGLE-3 head: acceptance and batch-1 speed before and after online training on the policy's rollouts.

A fresh head (random init) drafts for held-out prompts; then the warm-up recipe rolls the policy
out on training prompts (recording features and soft labels on the way) and trains the head for
``rounds x steps`` steps; the same held-out prompts are drafted again. The small drafter LM runs
the same prompts for comparison. Everything is measured in this one run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..drafter.eagle3 import Eagle3Config, Eagle3Head
from ..drafter.eagle3.train import DrafterTrainingConfig
from ..drafter.eagle3_warmup import WarmupConfig, WarmupRound, warmup_head
from ..rollout.params import SamplingParams
from .report import pyplot, save_figure
from .speculative import ForwardCost, SpecResult, measure_speculative

logger = logging.getLogger(__name__)


@dataclass
class Eagle3Bench:
    before: list[SpecResult]
    after: list[SpecResult]
    small_lm: list[SpecResult]
    rounds: list[WarmupRound]
    losses: list[float]
    train_steps: int
    aux_layer_ids: tuple[int, ...] = ()
    shipped: list[SpecResult] = field(default_factory=list)
    shipped_steps: int = 0


def measure_eagle3(
    model: torch.nn.Module,
    drafter_lm: torch.nn.Module,
    train_prompts: list[list[int]],
    held_out: list[list[int]],
    warmup_prompts: list[list[int]],
    params: SamplingParams,
    eos: list[int],
    *,
    rounds: int,
    steps_per_round: int,
    strategies: tuple[str, ...] = ("chain:5", "tree:4,2,8"),
    seed: int = 0,
    shipped: Eagle3Head | None = None,
) -> Eagle3Bench:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(model.config))

    def run(drafter, names) -> list[SpecResult]:
        return measure_speculative(
            model, drafter, held_out, warmup_prompts, params, (1,), names, {1: len(held_out)}, eos, workload="batch 1"
        )

    before = run(head, ("none", "chain:5"))
    cfg = WarmupConfig(
        rounds=rounds,
        steps_per_round=steps_per_round,
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        training=DrafterTrainingConfig(seed=seed),
        seed=seed,
    )
    head, trainer, warm_rounds = warmup_head(model, train_prompts, cfg, head=head, eos_token_ids=eos, progress=False)
    after = run(head, ("none", *strategies))
    small_lm = run(drafter_lm, ("chain:4",))
    losses = [r.loss for r in trainer.history]
    bench = Eagle3Bench(
        before, after, small_lm, warm_rounds, losses, trainer.step_count, tuple(head.config.aux_layer_ids)
    )
    if shipped is not None:
        bench.shipped = run(shipped, strategies)
        bench.shipped_steps = int(getattr(shipped, "version", 0))
    return bench


def eagle3_table(bench: Eagle3Bench) -> str:
    lines = [
        "| drafter | strategy | tok/s | vs none | mean accepted length | acceptance | draft s | verify s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [("none (no speculation)", r) for r in bench.after if r.strategy == "none"]
    rows += [("EAGLE-3 head, random init", r) for r in bench.before if r.strategy != "none"]
    rows += [(f"EAGLE-3 head, after {bench.train_steps} steps", r) for r in bench.after if r.strategy != "none"]
    rows += [(f"shipped EAGLE-3 head ({bench.shipped_steps} steps)", r) for r in bench.shipped]
    rows += [("small drafter LM", r) for r in bench.small_lm]
    base = next(r for r in bench.after if r.strategy == "none").tokens_per_s
    for name, r in rows:
        lines.append(
            f"| {name} | `{r.strategy}` | {r.tokens_per_s:,.0f} | {r.tokens_per_s / base:.2f}x | "
            f"{r.mean_accept_length:.2f} | {r.acceptance_rate:.2f} | {r.draft_s:.2f} | {r.verify_s:.2f} |"
        )
    return "\n".join(lines)


def plot_eagle3(bench: Eagle3Bench, path: Path) -> None:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    window = 10
    smooth = [
        sum(bench.losses[max(0, i - window + 1) : i + 1]) / len(bench.losses[max(0, i - window + 1) : i + 1])
        for i in range(len(bench.losses))
    ]
    left.plot(bench.losses, alpha=0.3, label="loss")
    left.plot(smooth, label=f"mean of {window}")
    left.set_xlabel("training step")
    left.set_ylabel("training-time-test loss")
    left.set_title("EAGLE-3 head: online training loss")
    left.legend()
    names = ["random init"] + [f"trained ({r.strategy})" for r in bench.after if r.strategy != "none"] + ["small LM"]
    values = [r.mean_accept_length for r in bench.before if r.strategy != "none"]
    values += [r.mean_accept_length for r in bench.after if r.strategy != "none"]
    values += [r.mean_accept_length for r in bench.small_lm]
    right.bar(range(len(values)), values, color=["#999", *["#1f77b4"] * (len(values) - 2), "#ff7f0e"])
    right.set_xticks(range(len(values)), names, rotation=15, fontsize=8)
    right.set_ylabel("mean accepted length (batch 1)")
    right.set_title("held-out prompts, T = 1.0")
    save_figure(fig, path)


def measure_head_cost(model: torch.nn.Module, head: Eagle3Head, context: int = 64, repeats: int = 30) -> ForwardCost:
    """Median time of one batch-1 head row (a chain draft step) over ``context`` cached rows."""
    import time

    from ..drafter.eagle3 import Eagle3Drafter
    from ..rollout.model.attention import SequenceSlice

    drafter = Eagle3Drafter(head, model, kv_cache_tokens=4 * (context + 16), block_size=16)
    table = drafter.cache.allocator.allocate(drafter.cache.num_blocks)
    h = head.config.hidden_size
    times = []
    was_training = head.training
    head.eval()
    try:
        with torch.no_grad():
            drafter._run(
                [SequenceSlice(table, 0, context)], torch.zeros(context, h), [1] * context, list(range(context))
            )
            for _ in range(repeats):
                start = time.perf_counter()
                drafter._run([SequenceSlice(table, context, 1)], torch.zeros(1, h), [2], [context])
                times.append(time.perf_counter() - start)
    finally:
        head.train(was_training)
    return ForwardCost("EAGLE-3 head", 1, 1000 * sorted(times)[len(times) // 2])
