"""Speculation on a trained hybrid policy, beside the attention-only deep policy it was distilled from.

The hybrid policy (``tasks/hybrid.py``: Qwen3.5-shaped, 18 Gated DeltaNet and 6 attention layers,
distilled from the deep policy on chain-sum) and the deep policy (24 attention layers), each with
its own drafter LM. Contenders: ``none``, ``chain:4`` drafted by the drafter LM, and ``adaptive``
(its warm passes: the same engine's later calls, as the next RL step finds it). Workloads: *batch
1* (a few prompts one at a time), *batch 16* (16 prompts together) and *the long tail* (a GRPO
rollout's prompts in one call, heavy-tailed lengths). T = 1 with position-keyed noise, so every
contender emits the same completions on a workload and the passes differ only in speed. Each
contender makes ``passes`` passes interleaved round by round (``adaptive._interleaved``); a
speedup is the median over rounds of ``none``'s seconds over the contender's in the same round.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..rollout.params import SamplingParams
from ..tasks.hybrid import DEFAULT_OUT
from .adaptive import RunResult, _EngineContender, _interleaved, same_pass_ratios
from .policies import BenchPolicy, task_prompts, torch_threads

HYBRID_POLICY_TITLE = "Speculation on a hybrid policy (Gated DeltaNet and attention, 3:1)"
ARMS = ("none", "chain:4", "adaptive")
WORKLOADS = {"batch 1": (12, 1), "batch 16": (16, 16), "long tail": (48, 256)}  # prompts, max_num_seqs


@dataclass
class PolicyRuns:
    """One policy's contenders on one workload: their merged passes and ``chain:4``'s accept length."""

    policy: str
    workload: str
    results: list[RunResult]
    chain_accept_length: float


def _policies() -> dict[str, tuple]:
    from ..tasks.hybrid import load_hybrid

    deep = BenchPolicy.load("deep")
    hybrid, tokenizer, drafter = load_hybrid()
    return {"hybrid": (hybrid, drafter, tokenizer), "attention-only (deep)": (deep.model, deep.drafter_lm, tokenizer)}


def measure(passes: int, workloads=WORKLOADS, seed: int = 0) -> list[PolicyRuns]:
    out = []
    with torch_threads(1):
        for name, (model, drafter, tokenizer) in _policies().items():
            eos = [tokenizer.eos_token_id]
            params = SamplingParams(temperature=1.0, max_new_tokens=384, noise="position", seed=seed)
            for workload, (num_prompts, max_num_seqs) in workloads.items():
                prompts = task_prompts(tokenizer, num_prompts, seed + 7)
                contenders = [
                    _EngineContender(a, model, drafter, prompts, params, eos, a, a == "adaptive", max_num_seqs)
                    for a in ARMS
                ]
                results = _interleaved(contenders, passes)
                stats = contenders[1].engine.stats.as_dict()
                accept = stats["spec_emitted_tokens"] / max(1, stats["spec_seq_steps"])
                out.append(PolicyRuns(name, workload, results, accept))
                for c in contenders:
                    c.engine.close()
    return out


def hybrid_policy_table(runs: list[PolicyRuns]) -> str:
    lines = [
        "| policy | workload | `none` tok/s | `chain:4` vs `none` (median, spread) | `chain:4` accept length "
        "| `adaptive` (warm) vs `none` |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        by = {x.name: x for x in r.results}
        chain = same_pass_ratios(r.results, "chain:4", "none")
        adaptive = same_pass_ratios(r.results, "adaptive (warm)", "none")
        lines.append(
            f"| {r.policy} | {r.workload} | {by['none'].tokens_per_s:.0f} | {statistics.median(chain):.2f}x "
            f"({min(chain):.2f}-{max(chain):.2f}) | {r.chain_accept_length:.2f} | {statistics.median(adaptive):.2f}x "
            f"({min(adaptive):.2f}-{max(adaptive):.2f}) |"
        )
    return "\n".join(lines)


def accuracy_line(evals: Path) -> str:
    """Each model's greedy accuracy from ``tailspec train-hybrid``'s eval stage, where it ran."""
    if not evals.exists():
        return "(Greedy accuracy: run `tailspec train-hybrid --stages eval`.)"
    scores = json.loads(evals.read_text())
    parts = [
        f"{name} {100 * e['accuracy']:.0f}% ({e['mean_completion_tokens']:.0f} tokens)" for name, e in scores.items()
    ]
    n = next(iter(scores.values()))["num_problems"]
    return f"Greedy accuracy on {n} held-out chain-sum problems (mean completion length): {', '.join(parts)}."


def run_hybrid_policy_section(out: Path, quick: bool = False) -> str:
    from .report import replace_section

    passes = 1 if quick else 3
    workloads = {"batch 1": (2, 1)} if quick else WORKLOADS
    runs = measure(passes, workloads)
    table = hybrid_policy_table(runs)
    body = (
        "The hybrid policy (`tailspec train-hybrid`: a Qwen3.5 of the deep policy's shape, 18 Gated DeltaNet and "
        "6 attention layers, distilled from the deep policy on chain-sum; its drafter LM the deep policy's "
        "distilled onto it) beside the attention-only deep policy with its own drafter LM. "
        f"Workloads: {', '.join(f'*{w}* ({n} prompts, at most {m} running)' for w, (n, m) in workloads.items())}; "
        "T = 1 with position-keyed noise (every contender emits the same completions), at most 384 new tokens, "
        f"one torch thread. Each contender makes {passes} passes interleaved round by round; a speedup is the "
        "median over rounds of `none`'s seconds over the contender's in the same round, with the spread. "
        "The Gated DeltaNet layers run transformers' torch reference for prefill and one-token steps, and "
        "tailspec's one-call verification (`rollout/model/delta_rule_rows.py`) for drafts.\n\n"
        f"{table}\n\n{accuracy_line(DEFAULT_OUT / 'eval.json')}"
    )
    with torch_threads(1):
        replace_section(out, HYBRID_POLICY_TITLE, body, "tailspec bench --section hybrid_policy")
    return table
