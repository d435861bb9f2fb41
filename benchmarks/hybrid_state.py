"""What a hybrid model's recurrent state costs a decode step, beside the attention-only model of its shape.

Two random Qwen3.5 models shaped like the deep policy (24 layers x hidden 256, 4 query and 2 K/V
heads of 64, MLP 768, its 54-token vocabulary): the *hybrid* with three Gated DeltaNet layers to every
attention layer (Qwen3.5's pattern), and its *attention-only* twin (every layer full attention).
Arms: ``none``, and ``chain:4`` drafted by the deep policy's drafter LM (random targets: its drafts
are mostly rejected, so each step verifies five rows and keeps about one, which is what a rollback
costs most). Per (model, arm, batch) each pass runs one rollout, interleaved; the table gives the
median over passes of each run's mean milliseconds per decode step (its spread), the hybrid's
share of it inside its Gated DeltaNet layers (forward hooks), and the memory a sequence holds:
its state slot, the rows a ``chain:4`` verification holds until its keep, and its K/V per token.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..rollout import RolloutConfig, RolloutEngine, SamplingParams
from ..rollout.model.recurrent_state import recurrent_mixers
from ..tasks.hybrid import hybrid_config
from .policies import BenchPolicy, torch_threads
from .step_host import ForwardClock

HYBRID_STATE_TITLE = "Recurrent state: what it costs a decode step"
ARMS = ("none", "chain:4")
BATCHES = (1, 16)
PROMPT_TOKENS = 16


def qwen35_like(hybrid: bool, deep_config, seed: int = 0) -> torch.nn.Module:
    """A random Qwen3.5 of the deep policy's shape (``tasks.hybrid.hybrid_config``): Qwen3.5's own
    pattern of three Gated DeltaNet layers then one attention layer, or all attention."""
    layers = deep_config.num_hidden_layers
    attention = range(3, layers, 4) if hybrid else range(layers)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hybrid_config(deep_config, tuple(attention)), dtype=torch.float32).eval()


@dataclass
class StateRun:
    """One (model, arm, batch) over the passes: each pass's mean ms per decode step and mixer share."""

    model: str
    arm: str
    batch: int
    step_ms: list[float] = field(default_factory=list)
    mixer_share: list[float] = field(default_factory=list)


def measure_run(model: torch.nn.Module, arm: str, batch: int, new_tokens: int, drafter) -> tuple[float, float, dict]:
    """(mean ms per decode step, the share of it in Gated DeltaNet layers, memory) of one rollout."""
    config = RolloutConfig(strategy=arm, max_num_seqs=batch, kv_cache_tokens=batch * (PROMPT_TOKENS + new_tokens + 48))
    engine = RolloutEngine(model, config, eos_token_ids=[1], drafter=drafter if arm != "none" else None)
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, model.config.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist(), params)
    clock = ForwardClock(recurrent_mixers(model))
    seconds, in_mixers, steps = 0.0, 0.0, 0
    try:
        with engine.inference():
            while engine.has_unfinished():
                prefills, decodes = engine.stats.prefill_steps, engine.stats.decode_steps
                before, start = clock.seconds, time.perf_counter()
                engine.step()
                if engine.stats.prefill_steps == prefills:
                    seconds += time.perf_counter() - start
                    in_mixers += clock.seconds - before
                    steps += engine.stats.decode_steps - decodes
    finally:
        clock.close()
        engine.close()
    return 1000 * seconds / steps, in_mixers / seconds, _memory(engine, arm)


def _memory(engine: RolloutEngine, arm: str) -> dict:
    kv = engine.runner.layout.bytes_per_token()  # what the paged cache holds a token
    states = engine.runner.states
    slot = states.bytes_per_slot() if states is not None else 0
    rows = 1 + int(arm.split(":")[1]) if arm.startswith("chain") else 0
    return {"slot": slot, "verify_rows": rows * slot, "kv_per_token": kv}


def measure(passes: int, new_tokens: int, batches=BATCHES, arms=ARMS) -> tuple[list[StateRun], dict]:
    deep = BenchPolicy.load("deep")
    models = {"hybrid": qwen35_like(True, deep.model.config), "attention": qwen35_like(False, deep.model.config)}
    runs = {(m, a, b): StateRun(m, a, b) for b in batches for a in arms for m in models}
    memory = {}
    with torch_threads(1):
        for model in models.values():  # warm-up: first calls of every path
            measure_run(model, "chain:4", 2, 4, deep.drafter_lm)
        for _ in range(passes):
            for b in batches:
                for a in arms:
                    for name, model in models.items():
                        ms, share, memory[(name, a)] = measure_run(model, a, b, new_tokens, deep.drafter_lm)
                        runs[(name, a, b)].step_ms.append(ms)
                        runs[(name, a, b)].mixer_share.append(share)
    return list(runs.values()), memory


def hybrid_state_table(runs: list[StateRun]) -> str:
    by = {(r.model, r.arm, r.batch): r for r in runs}
    lines = [
        "| batch | arm | hybrid ms / step (median, spread) | attention-only ms / step | hybrid / attention-only "
        "| in Gated DeltaNet layers |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for b in sorted({r.batch for r in runs}):
        for a in ARMS:
            h, t = by[("hybrid", a, b)], by[("attention", a, b)]
            ratios = [x / y for x, y in zip(h.step_ms, t.step_ms)]
            lines.append(
                f"| {b} | {a} | {statistics.median(h.step_ms):.1f} ({min(h.step_ms):.1f}-{max(h.step_ms):.1f}) "
                f"| {statistics.median(t.step_ms):.1f} | {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f}) | {100 * statistics.median(h.mixer_share):.0f}% |"
            )
    return "\n".join(lines)


def verification_line(runs: list[StateRun]) -> str:
    """What a ``chain:4`` step costs against a ``none`` step on each model, at each batch."""
    ms = {(r.model, r.arm, r.batch): statistics.median(r.step_ms) for r in runs}
    parts = []
    for b in sorted({r.batch for r in runs}):
        hybrid = ms[("hybrid", "chain:4", b)] / ms[("hybrid", "none", b)]
        twin = ms[("attention", "chain:4", b)] / ms[("attention", "none", b)]
        parts.append(f"{hybrid:.1f}x on the hybrid against {twin:.1f}x on the twin at batch {b}")
    return (
        "A `chain:4` step costs a `none` step's time " + ", ".join(parts) + ": a verification runs each Gated "
        "DeltaNet layer's projections and convolution once over its rows and only the delta rule row by row "
        "(`rollout/model/delta_rule_rows.py`), each row's state held until the keep."
    )


def memory_line(memory: dict) -> str:
    hybrid, twin = memory[("hybrid", "chain:4")], memory[("attention", "chain:4")]
    slot, kv, twin_kv = hybrid["slot"], hybrid["kv_per_token"], twin["kv_per_token"]
    return (
        f"Memory a sequence holds: the hybrid's state slot, {slot / 1024:.0f} KiB (18 Gated DeltaNet layers' "
        f"convolution inputs and fp32 delta-rule states: the attention-only twin's K/V of {slot / twin_kv:.0f} "
        f"tokens), and {hybrid['verify_rows'] / 1024:.0f} KiB more while a `chain:4` verification holds its five "
        f"rows' states; K/V {kv / 1024:.1f} KiB a token (the paged cache holds its 6 attention layers' only) "
        f"against the twin's {twin_kv / 1024:.1f} KiB (24)."
    )


def run_hybrid_state_section(out: Path, quick: bool = False) -> str:
    from .report import replace_section

    passes, new_tokens = (1, 4) if quick else (3, 32)
    runs, memory = measure(passes, new_tokens)
    table = hybrid_state_table(runs)
    body = (
        "Random Qwen3.5 models of the deep policy's shape (24 layers x hidden 256): the hybrid (three Gated "
        "DeltaNet layers to every attention layer) and its attention-only twin; `none`, and `chain:4` drafted by "
        "the deep policy's drafter LM (on random targets its drafts are mostly rejected: each step verifies five "
        "rows and keeps about one). Greedy, "
        f"{new_tokens} new tokens from {PROMPT_TOKENS}-token prompts, one torch thread, wall ms per decode step: "
        f"the median over {passes} interleaved passes, with the spread; the Gated DeltaNet layers run "
        "transformers' torch reference for prefill and one-token steps (no flash-linear-attention on this "
        "machine) and tailspec's one-call verification for drafts.\n\n"
        f"{table}\n\n{verification_line(runs)}\n\n{memory_line(memory)}"
    )
    with torch_threads(1):  # the section's machine line names the threads it was measured with
        replace_section(out, HYBRID_STATE_TITLE, body, "tailspec bench --section hybrid_state")
    return table
