"""The selector stage: ``adaptive``'s calibration and choice on the GPU.

On the grown policy with the drafter LM: how long calibration takes, the step time it predicts
for every arm of its own arm set against the step time that arm's engine measures at batch 1, 16
and 64, graph captures during timed runs, and ``adaptive`` against every fixed arm of its arm set
at those batch sizes and on a long-tail rollout, contenders interleaved, three repeats each
(METHOD.md of the device entry): medians and spread. Each repeat (and the warm-up before them)
draws its own prompts and sampling seeds: a repeat of the same greedy rollout would hand the
suffix drafter, which indexes every earlier rollout, the whole answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...rollout.model.graph_pool import capture_seconds
from ...rollout.params import DEFAULT_ARMS, SamplingParams
from ...rollout.strategy import parse_strategy
from ...tasks.sft import load_shipped
from ..policies import task_prompts
from .common import Stage, device, graph_backend, median, timed
from .speed import Contenders, grow

REPEATS = 3  # on the GPU; the CPU rehearsal runs one, on batch 1 and the long tail only


def predicted_against_measured(engine, adaptive, batch: int) -> tuple[float, float] | None:
    """The adaptive selector's predicted seconds of ``engine``'s arm on ``batch`` sequences, and the
    median measured decode step of that engine with ``batch`` running (None if it ran none)."""
    arm = parse_strategy(engine.config.strategy)
    steps = [r.seconds for r in engine.stats.step_log if r.num_active == batch]
    if not steps:
        return None
    return adaptive.selector.costs.seconds(arm, batch), median(steps)


@dataclass
class Timings:
    """Per (workload, contender): seconds of each timed run and of graph captures inside it; per
    workload: ``adaptive``'s decode steps per arm over its timed runs."""

    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    captures: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    mix: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, workload: str, arm: str, seconds: float, captured: float, steps: dict[str, int]) -> None:
        self.seconds.setdefault((workload, arm), []).append(seconds)
        self.captures.setdefault((workload, arm), []).append(captured)
        if arm == "adaptive":
            mix = self.mix.setdefault(workload, {})
            for k, v in steps.items():
                mix[k] = mix.get(k, 0) + v

    def record(self, stage: Stage) -> None:
        stage.record("seconds", {f"{w} / {a}": v for (w, a), v in self.seconds.items()})
        stage.record("captures_s", {f"{w} / {a}": [round(x, 3) for x in v] for (w, a), v in self.captures.items()})
        stage.record("adaptive_strategy_steps", self.mix)


def calibrate(stage: Stage, contenders: Contenders, graphs: str) -> None:
    adaptive = contenders.engine("adaptive", graphs)
    start, captured = time.perf_counter(), capture_seconds()
    adaptive.choice.calibrate(adaptive.config.max_num_seqs, fresh=True)  # every batch the workloads reach
    stage.record(
        "calibration",
        {
            "seconds": round(time.perf_counter() - start, 3),
            "capture_s": round(capture_seconds() - captured, 3),
            "shapes": len(adaptive.selector.costs.table.measured),
        },
    )


def workloads(size, tokenizer, batches, repeats: int) -> list[tuple[str, list]]:
    """Per workload, (prompts, params) of the warm-up and then of each timed repeat: fresh prompts and
    seeds every time (the suffix drafter indexes every earlier rollout)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=size.max_new_tokens)
    prompt_sets = [task_prompts(tokenizer, max(batches), seed=41 + r) for r in range(repeats + 1)]
    out = [(str(b), [(p[:b], greedy) for p in prompt_sets]) for b in batches]
    n = size.long_tail_prompts
    tail = []
    for r in range(repeats + 1):
        seeds = range(500 + 1000 * r, 500 + 1000 * r + n)
        params = [
            SamplingParams(temperature=1.0, max_new_tokens=2 * size.max_new_tokens, noise="position", seed=s)
            for s in seeds
        ]
        tail.append((task_prompts(tokenizer, n, seed=143 + r), params))
    return [*out, ("long tail", tail)]


def time_workload(contenders: Contenders, graphs: str, arms, name: str, runs, repeats: int, timings: Timings) -> None:
    """Warm every contender up, then time each repeat, contenders interleaved (rotated per repeat)."""
    for arm in arms:  # warm: graphs captured, the selector measured, kernels compiled
        contenders.engine(arm, graphs).generate(*runs[0])
    for rep in range(repeats):
        for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
            engine = contenders.engine(arm, graphs)
            before, steps = capture_seconds(), dict(engine.stats.strategy_steps)
            _, s = timed(lambda e=engine, r=runs[rep + 1]: e.generate(*r))
            ran = {k: v - steps.get(k, 0) for k, v in engine.stats.strategy_steps.items() if v > steps.get(k, 0)}
            timings.add(name, arm, s, capture_seconds() - before, ran)


def judge(stage: Stage, name: str, arms, repeats: int, timings: Timings) -> dict:
    """``adaptive`` against the best fixed arm on workload ``name``, with and without captures."""
    seconds, captures = timings.seconds, timings.captures
    # steady: each run without the seconds its graph pools spent capturing (a training run of
    # hundreds of rollouts pays each capture once)
    steady = {a: [s - c for s, c in zip(seconds[(name, a)], captures[(name, a)])] for a in arms if (name, a) in seconds}
    summary: dict = {"strategy steps of adaptive": timings.mix.get(name, {})}
    for label, runs in (("", {a: seconds[(name, a)] for a in steady}), ("steady ", steady)):
        fixed = {a: median(v) for a, v in runs.items() if a != "adaptive"}
        best = min(fixed, key=fixed.get)
        ratio = fixed[best] / median(runs["adaptive"])
        per_repeat = [min(runs[a][r] for a in fixed) / runs["adaptive"][r] for r in range(repeats)]
        summary[f"{label}adaptive / best fixed ({best})"] = round(ratio, 3)
        summary[f"{label}per repeat, against that repeat's fastest"] = [round(x, 3) for x in per_repeat]
        stage.target(
            f"{name}: {label}adaptive at least 0.97x the best fixed arm ({best})", ratio >= 0.97, f"{ratio:.3f}"
        )
    adaptive_captures = sum(captures[(name, "adaptive")])
    summary["captures in adaptive's timed runs (s)"] = round(adaptive_captures, 3)
    most = max(sum(v) for (w, a), v in captures.items() if w == name and a != "adaptive")
    summary["most captures of a fixed arm's timed runs (s)"] = round(most, 3)
    stage.target(f"{name}: no graph capture in adaptive's timed runs", adaptive_captures < 1e-3)
    return summary


def predictions(stage: Stage, contenders: Contenders, graphs: str, batches) -> dict:
    """What ``adaptive`` predicts for each arm's step against what that arm's engine measured."""
    out: dict = {}
    adaptive = contenders.engines.get(("adaptive", graphs, "auto"))
    if adaptive is None:
        return out
    for b in batches:
        for arm in DEFAULT_ARMS:
            engine = contenders.engines.get((arm, graphs, "auto"))
            pair = predicted_against_measured(engine, adaptive, b) if engine is not None else None
            if pair is not None:
                out[f"{arm} batch {b}"] = {"predicted_ms": 1e3 * pair[0], "measured_ms": 1e3 * pair[1]}
    off = [abs(p["predicted_ms"] / p["measured_ms"] - 1) for p in out.values()]
    stage.target(
        "predicted step times within 10% of measured", bool(off) and max(off) <= 0.1, f"worst {max(off or [0]):.1%}"
    )
    return out


def rankings(adaptive, batches, max_new_tokens: int) -> dict:
    """How ``adaptive`` ranks its arms at the end, at each batch size with a full rollout's work
    left: per arm its predicted step seconds, expected tokens per sequence-step (point estimate
    and with optimism) and predicted finish; what it picks and why, for the next look."""
    out = {}
    for b in batches:
        ranked = adaptive.selector.predictions(b, b * max_new_tokens)
        out[f"batch {b}"] = [
            {
                "arm": str(p.arm),
                "step_ms": round(1e3 * p.seconds, 3),
                "expected": round(p.expected, 3),
                "hopeful": round(p.hopeful, 3),
                "finish_s": round(p.finish_s, 4),
            }
            for p in ranked
        ]
    return out


def run(stage: Stage) -> None:
    dev = device()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    graphs, size = graph_backend(), stage.size
    drafter, tokenizer = load_shipped("deep", "drafter", dtype=dtype)
    full = size.name == "full"
    repeats, batches = (REPEATS, size.spec_batches) if full else (1, size.spec_batches[:1])
    loads = workloads(size, tokenizer, batches, repeats)
    with stage.part("grow", 20) as ok:
        if not ok:
            return
        policy = grow(stage, dev, dtype, task_prompts(tokenizer, 4, seed=41))
    max_num_seqs = max(*batches, size.long_tail_prompts)
    contenders = Contenders(policy, drafter.to(dev), tokenizer, max_num_seqs, kv_cache_tokens=size.kv_cache_tokens)
    arms = [*DEFAULT_ARMS, "adaptive"]
    with stage.part("calibration", 15) as ok:
        if ok:
            calibrate(stage, contenders, graphs)
    timings = Timings()
    for name, runs in loads:
        with stage.part(f"{name}: adaptive against its arms", 8 * len(arms)) as ok:
            if ok:
                time_workload(contenders, graphs, arms, name, runs, repeats, timings)
                timings.record(stage)
    summary = {
        name: judge(stage, name, arms, repeats, timings) for name, _ in loads if (name, "adaptive") in timings.seconds
    }
    stage.record("predicted_vs_measured", predictions(stage, contenders, graphs, batches))
    adaptive = contenders.engines.get(("adaptive", graphs, "auto"))
    if adaptive is not None:
        stage.record("rankings", rankings(adaptive, batches, size.max_new_tokens))
    stage.record("headline", summary)
    contenders.close()
