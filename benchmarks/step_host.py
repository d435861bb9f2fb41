"""One decode step's host time: a step's wall time less its model forwards, per strategy and batch.

What the host does in a decode step (scheduling, sampling and reading the tokens back, the
drafting's glue, verification, committing tokens and K/V, the bookkeeping) is time a GPU idles
between kernels unless the next step is already launched. This section measures it on the CPU:
the target and the drafter LM are one-layer models 16 wide, whose forwards cost next to nothing,
and every forward's time (the target's, the drafter LM's: hooks on both modules) is subtracted
from each decode step's wall time. Arms: ``none``, ``chain:4`` and ``tree:4,2,8`` with the drafter
LM (a perturbed copy of the target: long accepted runs at greedy; launched from state on the
device) and ``suffix`` (drafted from the host's text); batch 1, 16, 64 and 256; every pass runs
each (arm, batch) once, interleaved; the table gives the median over passes of each
run's mean host milliseconds per decode step, with the spread, and the accepted tokens per step.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..rollout import RolloutConfig, RolloutEngine, SamplingParams
from ..testing import perturbed_copy, tiny_random_model
from .policies import torch_threads

STEP_HOST_TITLE = "Host time of one decode step"
ARMS = ("none", "chain:4", "tree:4,2,8", "suffix")
BATCHES = (1, 16, 64, 256)
PROMPT_TOKENS = 8


@dataclass
class HostRun:
    """One (arm, batch) over the passes: each pass's mean host and forward ms per decode step."""

    arm: str
    batch: int
    host_ms: list[float] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)
    tokens_per_step: list[float] = field(default_factory=list)


class ForwardClock:
    """Seconds spent inside the forwards of the hooked modules (pre and post forward hooks)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.seconds = 0.0
        self._started: list[float] = []
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._start))
            self._handles.append(module.register_forward_hook(self._stop))

    def _start(self, *_) -> None:
        self._started.append(time.perf_counter())

    def _stop(self, *_) -> None:
        self.seconds += time.perf_counter() - self._started.pop()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A target and a drafter LM whose forwards cost next to nothing."""
    sizes = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=128)
    target = tiny_random_model("llama", seed=1, max_position_embeddings=1024, **sizes)
    return target, perturbed_copy(target, noise=0.02, seed=2)


def measure_run(arm: str, batch: int, new_tokens: int, target, drafter) -> tuple[float, float, float]:
    """(mean host ms, mean forward ms, tokens emitted) per decode step of one rollout of ``batch``
    prompts under ``arm``; prefill steps are left out. A full garbage collection first: each run
    starts from the same heap, so where the collector's slow passes land is not the arms' doing."""
    gc.collect()
    kv_tokens = batch * (PROMPT_TOKENS + new_tokens + 32)
    config = RolloutConfig(strategy=arm, max_num_seqs=batch, kv_cache_tokens=kv_tokens, seed=0)
    engine = RolloutEngine(target, config, eos_token_ids=[1], drafter=drafter if arm != "none" else None)
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(2, 128, (PROMPT_TOKENS,), generator=gen).tolist(), params)
    clock = ForwardClock([target, drafter])
    host, forward, steps = 0.0, 0.0, 0
    try:
        with engine.inference():
            while engine.has_unfinished():
                prefills, decodes = engine.stats.prefill_steps, engine.stats.decode_steps
                before, start = clock.seconds, time.perf_counter()
                engine.step()
                seconds, in_forward = time.perf_counter() - start, clock.seconds - before
                if engine.stats.prefill_steps == prefills:  # a decode step, or the commit of the last
                    host += seconds - in_forward
                    forward += in_forward
                    steps += engine.stats.decode_steps - decodes
    finally:
        clock.close()
        engine.close()
    emitted = engine.stats.generated_tokens - batch  # the prefill steps' first tokens left out
    return 1000 * host / steps, 1000 * forward / steps, emitted / (steps * batch)


def measure(passes: int, new_tokens: int, batches=BATCHES, arms=ARMS) -> list[HostRun]:
    target, drafter = models()
    runs = {(a, b): HostRun(a, b) for b in batches for a in arms}
    with torch_threads(1):
        measure_run("chain:4", 4, 8, target, drafter)  # warm-up: first calls of every path
        for _ in range(passes):
            for b in batches:
                for a in arms:
                    host, forward, per_step = measure_run(a, b, new_tokens, target, drafter)
                    run = runs[(a, b)]
                    run.host_ms.append(host)
                    run.forward_ms.append(forward)
                    run.tokens_per_step.append(per_step)
    return list(runs.values())


def step_host_table(runs: list[HostRun]) -> str:
    lines = [
        "| batch | arm | host ms / step (median, spread) | host us / sequence | forwards ms / step "
        "| tokens / sequence-step |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        host = statistics.median(r.host_ms)
        lines.append(
            f"| {r.batch} | {r.arm} | {host:.2f} ({min(r.host_ms):.2f}-{max(r.host_ms):.2f}) "
            f"| {1000 * host / r.batch:.0f} | {statistics.median(r.forward_ms):.2f} "
            f"| {statistics.median(r.tokens_per_step):.2f} |"
        )
    return "\n".join(lines)


def run_step_host_section(out: Path, quick: bool = False) -> str:
    from .report import replace_section

    passes, new_tokens = (1, 8) if quick else (5, 48)
    table = step_host_table(measure(passes, new_tokens))
    body = (
        "Each decode step's wall time less the time inside the target's and the drafter LM's forwards "
        "(one-layer models 16 wide: their forwards cost next to nothing), per step, greedy, "
        f"{new_tokens} new tokens per request from {PROMPT_TOKENS}-token prompts, one torch thread; the "
        f"median over {passes} interleaved passes of each run's mean, with the spread. This is what the "
        "host adds to every step on any device, and on a GPU what the device waits for unless the next "
        "step is launched before this one is read.\n\n"
        f"{table}"
    )
    with torch_threads(1):  # the section's machine line names the threads it was measured with
        replace_section(out, STEP_HOST_TITLE, body, "tailspec bench --section step_host")
    return table
