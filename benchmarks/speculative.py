"""Speculative decoding against no speculation, side by side on the same engine settings.

For each batch size and strategy a fresh engine (same target, same drafter) generates the same
prompt batches after a warm-up on other prompts; tokens/s counts completion tokens (what the
trainer gets), and the engine's own counters give the mean accepted length and the split of
speculative-step time between drafting and verification.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from ..progress import progress_bar
from ..rollout.engine import RolloutEngine
from ..rollout.params import RolloutConfig, SamplingParams
from .report import pyplot, save_figure

logger = logging.getLogger(__name__)


@dataclass
class SpecResult:
    workload: str
    strategy: str
    batch_size: int
    num_prompts: int
    completion_tokens: int
    seconds: float
    mean_accept_length: float
    acceptance_rate: float
    draft_s: float
    verify_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def measure_speculative(
    model: torch.nn.Module,
    drafter: torch.nn.Module | None,
    prompts: Sequence[Sequence[int]],
    warmup_prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    batch_sizes: Sequence[int],
    strategies: Sequence[str],
    prompts_per_size: dict[int, int],
    eos_token_ids: Sequence[int],
    workload: str = "distinct prompts",
    group_size: int = 1,
    base_config: RolloutConfig | None = None,
) -> list[SpecResult]:
    """Tokens/s per (batch size, strategy). With ``group_size > 1`` each batch holds
    ``batch_size / group_size`` prompts repeated ``group_size`` times, as GRPO samples them."""
    base = asdict(base_config or RolloutConfig())
    results = []
    cells = [(bs, s) for bs in batch_sizes for s in strategies]
    for bs, strategy in progress_bar(cells, desc=f"speculative ({workload})", unit="run"):
        n = prompts_per_size.get(bs, bs)
        distinct = max(1, n // group_size)
        chosen = [list(prompts[i % len(prompts)]) for i in range(distinct) for _ in range(group_size)]
        batches = [chosen[i : i + bs] for i in range(0, len(chosen), bs)]
        config = RolloutConfig(**{**base, "strategy": strategy})
        engine = RolloutEngine(model, config, drafter=drafter, eos_token_ids=eos_token_ids)
        engine.generate([list(p) for p in warmup_prompts], params.with_updates(max_new_tokens=16))
        stats_before = engine.stats.as_dict()
        torch.manual_seed(0)
        tokens, start = 0, time.perf_counter()
        for batch in batches:
            tokens += sum(len(o.completion_ids) for o in engine.generate(batch, params))
        seconds = time.perf_counter() - start
        now = engine.stats.as_dict()
        drafted = now["drafted_tokens"] - stats_before["drafted_tokens"]
        accepted = now["accepted_tokens"] - stats_before["accepted_tokens"]
        seq_steps = now["spec_seq_steps"] - stats_before["spec_seq_steps"]
        emitted = now["spec_emitted_tokens"] - stats_before["spec_emitted_tokens"]
        result = SpecResult(
            workload=workload,
            strategy=str(engine.strategy),
            batch_size=bs,
            num_prompts=len(chosen),
            completion_tokens=tokens,
            seconds=seconds,
            mean_accept_length=emitted / seq_steps if seq_steps else 1.0,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            draft_s=now["draft_time_s"] - stats_before["draft_time_s"],
            verify_s=now["verify_time_s"] - stats_before["verify_time_s"],
        )
        logger.info(
            "%s bs=%d %s: %.0f tok/s, accept length %.2f",
            workload,
            bs,
            result.strategy,
            result.tokens_per_s,
            result.mean_accept_length,
        )
        results.append(result)
    return results


def speculative_table(results: Sequence[SpecResult]) -> str:
    """One row per (workload, batch size, strategy), with the speedup over ``none`` in the same cell."""
    baseline = {(r.workload, r.batch_size): r for r in results if r.strategy == "none"}
    lines = [
        "| workload | batch | strategy | tok/s | vs none | mean accepted length | acceptance | draft s | verify s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        base = baseline.get((r.workload, r.batch_size))
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "n/a"
        spec = r.strategy != "none"
        lines.append(
            f"| {r.workload} | {r.batch_size} | `{r.strategy}` | {r.tokens_per_s:,.0f} | {ratio} | "
            f"{r.mean_accept_length:.2f} | {f'{r.acceptance_rate:.0%}' if spec else '-'} | "
            f"{f'{r.draft_s:.2f}' if spec else '-'} | {f'{r.verify_s:.2f}' if spec else '-'} |"
        )
    return "\n".join(lines)


def plot_speculative(results: Sequence[SpecResult], path) -> None:
    plt = pyplot()

    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rows = [r for r in results if r.workload == workload]
        sizes = sorted({r.batch_size for r in rows})
        strategies = list(dict.fromkeys(r.strategy for r in rows))
        width = 0.8 / len(strategies)
        for j, strategy in enumerate(strategies):
            vals = [
                next((r.tokens_per_s for r in rows if r.batch_size == s and r.strategy == strategy), 0.0) for s in sizes
            ]
            offsets = [i + (j - (len(strategies) - 1) / 2) * width for i in range(len(sizes))]
            ax.bar(offsets, vals, width, label=strategy)
        ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("completion tokens / s")
        ax.set_title(f"Speculative strategies ({workload})")
        ax.legend(fontsize=7)
    save_figure(fig, path)


@dataclass
class ForwardCost:
    model: str
    query_tokens: int
    ms: float


def measure_forward_cost(
    model: torch.nn.Module,
    name: str,
    query_tokens: Sequence[int] = (1, 2, 3, 5, 9, 17),
    context: int = 64,
    repeats: int = 30,
) -> list[ForwardCost]:
    """Median time of one batch-1 forward over ``context`` cached tokens with ``q`` new tokens:
    what verifying a draft of ``q - 1`` tokens costs relative to one plain decode step."""
    from ..rollout.model.attention import SequenceSlice, paged_attention_enabled
    from ..rollout.model.runner import ModelRunner

    block = 16
    num_blocks = (context + max(query_tokens)) // block + 2
    runner = ModelRunner(model, num_blocks, block)
    table = runner.cache.allocator.allocate(num_blocks)
    vocab = runner.vocab_size
    out = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), paged_attention_enabled(model):
            prefix = [i % vocab for i in range(context)]
            runner.forward([SequenceSlice(table, 0, context)], prefix, list(range(context)), [context - 1])
            for q in query_tokens:
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    runner.forward(
                        [SequenceSlice(table, context, q)],
                        [(7 * i) % vocab for i in range(q)],
                        list(range(context, context + q)),
                        list(range(q)),
                    )
                    times.append(time.perf_counter() - start)
                out.append(ForwardCost(name, q, 1000 * sorted(times)[len(times) // 2]))
    finally:
        model.train(was_training)
    return out


def forward_cost_table(costs: Sequence[ForwardCost]) -> str:
    models = list(dict.fromkeys(c.model for c in costs))
    sizes = sorted({c.query_tokens for c in costs})
    by = {(c.model, c.query_tokens): c.ms for c in costs}
    lines = ["| model | " + " | ".join(f"{q} tok" for q in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for m in models:
        base = by[(m, sizes[0])]
        cells = [f"{by[(m, q)]:.2f} ms ({by[(m, q)] / base:.1f}x)" for q in sizes]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
