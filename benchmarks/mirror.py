"""Mirror speculative decoding vs serial drafting, at batch 1, 4 and 16 and on a long-tail rollout.

Every arm runs in its own engine over the same policy (one torch thread for the target; the
mirror arms' draft process has its own thread, on the machine's second core), passes interleaved
arm by arm; ratios are medians of same-pass ratios. Also reported: the early exit's agreement
with the target's own next token by layer and k, the bound (the share of a serial round spent
drafting), the reuse rate (rounds whose draft was ready) and the drafting taken off the critical
path.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from ..drafter.small_lm import SmallLMDrafter
from ..drafter.streaming import StreamingHeads, fit_streaming_heads
from ..rollout import RolloutConfig, RolloutEngine, SamplingParams
from ..rollout.mirror.drafter import mirror_pipeline
from ..rollout.model.early_exit import exit_agreement
from ..rollout.params import DEFAULT_ARMS, SelectorConfig
from .policies import BenchPolicy, task_prompts, torch_threads
from .report import pyplot, save_figure

logger = logging.getLogger(__name__)

SERIAL_ARMS = ("none", "chain:2", "chain:4", "chain:6", "tree:4,2,8", "suffix", "eagle3 chain:4", "eagle3 chain:6")
MIRROR_ARMS = (
    "mirror:chain:4,k=0",
    "mirror:chain:6,k=0",
    "mirror:chain:6,k=1",
    "eagle3 mirror:chain:4,k=0",
    "eagle3 mirror:chain:6,k=0",
    "mirror:chain:4,k=0 @ray",  # the draft host a Ray actor (here on this machine's spare core)
    "streaming chain:6",  # the drafter LM with one streaming head (two draft tokens per forward)
    "streaming mirror:chain:6,k=0",
)
TAIL_MIRROR_ARMS = ("mirror:chain:4,k=0", "mirror:chain:6,k=0")
BASELINE = "chain:4"  # the mirror arms' own serial arm (the drafter LM, chain of 4)


@dataclass
class MirrorBenchConfig:
    policy: str = "deep"
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    prompts: int = 12  # per batch size (batch 1 runs them one by one)
    max_new_tokens: int = 192
    temperature: float = 1.0
    passes: int = 3
    exit_layer: int = 7
    tail_prompts: int = 6  # the long-tail rollout: groups of ...
    tail_samples: int = 4  # ... samples each
    tail_max_new_tokens: int = 384
    tail_passes: int = 5  # a tail pass is short; its ratios spread more than the batch arms'
    seed: int = 11

    @classmethod
    def quick(cls) -> MirrorBenchConfig:
        return cls(
            batch_sizes=(1, 4),
            prompts=2,
            max_new_tokens=48,
            passes=1,
            tail_prompts=2,
            tail_samples=2,
            tail_max_new_tokens=64,
            tail_passes=1,
        )


@dataclass
class ArmResult:
    arm: str
    batch: int
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # same-pass tok/s over the baseline's
    draft_share: float = 0.0  # of a speculative step's time spent drafting (serial arms)
    mirror: dict[str, float] = field(default_factory=dict)
    accept_length: float = 0.0
    # the long-tail rollout's measured passes by active sequences (bucket bound):
    # [seconds, tokens emitted, seconds in mirror steps]
    by_batch: dict[int, list[float]] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds))

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else 1.0


@dataclass
class MirrorResult:
    config: MirrorBenchConfig
    describe: str
    agreement: dict[int, dict[int, float]]
    arms: list[ArmResult]
    tail: list[ArmResult]
    round_trip_ms: dict[str, float] = field(default_factory=dict)  # per draft host: an empty command there and back
    head_loss: tuple[float, float] = (0.0, 0.0)  # the streaming head's fit: first and last step's cross-entropy


def _engine(policy: BenchPolicy, arm: str, cfg: MirrorBenchConfig, max_num_seqs: int, selector=None, heads=None):
    drafter = policy.head if arm.startswith("eagle3") else policy.drafter_lm
    if arm.startswith("streaming"):
        drafter = SmallLMDrafter(policy.drafter_lm, streaming_heads=heads)
    strategy, _, host = arm.removeprefix("eagle3 ").removeprefix("streaming ").partition(" @")
    config = RolloutConfig(
        strategy="adaptive" if selector is not None else strategy,
        selector=selector,
        kv_cache_tokens=max(8192, max_num_seqs * (cfg.tail_max_new_tokens + 256)),
        max_num_seqs=max_num_seqs,
        # auto: a draft process on CPU (the drafter LM and the EAGLE-3 head alike); "@ray": a Ray actor
        mirror={"exit_layer": cfg.exit_layer, "executor": host or "auto"},
        seed=cfg.seed,
    )
    return RolloutEngine(policy.model, config, tokenizer=policy.tokenizer, drafter=drafter)


def _run(engine: RolloutEngine, prompts: list[list[int]], batch: int, params: SamplingParams) -> tuple[float, int]:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(len(o.completion_ids) for o in engine.generate(prompts[i : i + batch], params))
    return time.perf_counter() - start, tokens


def _passes(engines: dict[str, RolloutEngine], results: dict[str, ArmResult], run, passes: int, baseline: str):
    for p in range(passes):
        for arm, engine in engines.items():
            seconds, tokens = run(engine)
            results[arm].seconds.append(seconds)
            results[arm].tokens.append(tokens)
            logger.info("mirror bench pass %d %s: %.2f s, %d tokens", p, arm, seconds, tokens)
        base = results[baseline]
        for r in results.values():
            r.ratios.append((r.tokens[-1] / r.seconds[-1]) / (base.tokens[-1] / base.seconds[-1]))


def _fit_heads(policy: BenchPolicy, cfg: MirrorBenchConfig) -> tuple[StreamingHeads, tuple[float, float]]:
    """One streaming head for the drafter LM, fitted on 48 of the policy's own completions (other
    prompts than the measured ones)."""
    prompts = task_prompts(policy.tokenizer, 48, cfg.seed + 99)
    engine = RolloutEngine(
        policy.model, RolloutConfig(kv_cache_tokens=32768, max_num_seqs=48), tokenizer=policy.tokenizer
    )
    outs = engine.generate(prompts, SamplingParams(temperature=cfg.temperature, max_new_tokens=256))
    heads = StreamingHeads(policy.drafter_lm.config.hidden_size, 1)
    losses = fit_streaming_heads(
        policy.drafter_lm, heads, [p + o.completion_ids for p, o in zip(prompts, outs)], steps=300
    )
    return heads, (losses[0], losses[-1])


def _round_trips(engines: dict[str, RolloutEngine]) -> dict[str, float]:
    from ..rollout.mirror.hosted import round_trip_s

    out = {}
    for engine in engines.values():
        pipeline = mirror_pipeline(engine.drafters)
        executor = pipeline.executor if pipeline is not None else None
        if executor is not None and hasattr(executor, "call") and executor.name not in out:
            out[executor.name] = 1e3 * round_trip_s(executor)
    return out


def _finish(engine: RolloutEngine, result: ArmResult) -> None:
    st = engine.stats
    if st.spec_steps:
        result.draft_share = st.draft_time_s / max(st.draft_time_s + st.verify_time_s, 1e-9)
        result.accept_length = st.spec_emitted_tokens / max(st.spec_seq_steps, 1)
    if (pipeline := mirror_pipeline(engine.drafters)) is not None:
        m = pipeline.stats
        result.mirror = {
            "reuse": m.reuse_rate,
            "serial_ms": 1e3 * m.serial_draft_s / max(m.steps, 1),
            "wait_ms": 1e3 * m.wait_s / max(m.steps, 1),
            "branches": m.branches / max(m.rounds, 1),
        }
    engine.close()


def measure_mirror(cfg: MirrorBenchConfig) -> MirrorResult:
    policy = BenchPolicy.load(cfg.policy)
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    prompts = task_prompts(policy.tokenizer, cfg.prompts, cfg.seed)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        return _measure(policy, cfg, params, prompts)
    finally:
        ray.shutdown()


def _measure(policy: BenchPolicy, cfg: MirrorBenchConfig, params: SamplingParams, prompts) -> MirrorResult:
    round_trips: dict[str, float] = {}
    with torch_threads(1):
        plain = RolloutEngine(policy.model, RolloutConfig(kv_cache_tokens=8192), tokenizer=policy.tokenizer)
        outs = plain.generate(prompts[:8], params.with_updates(temperature=0.0))
        agreement = exit_agreement(
            policy.model, [p + o.completion_ids for p, o in zip(prompts, outs)], [len(p) for p in prompts], (1, 2, 4)
        )
        heads, head_loss = _fit_heads(policy, cfg)
        arms: list[ArmResult] = []
        for batch in cfg.batch_sizes:
            names = [*SERIAL_ARMS, *MIRROR_ARMS]
            engines = {a: _engine(policy, a, cfg, batch, heads=heads) for a in names}
            results = {a: ArmResult(a, batch) for a in names}
            _passes(engines, results, lambda e, b=batch: _run(e, prompts, b, params), cfg.passes, BASELINE)
            round_trips = round_trips or _round_trips(engines)
            for a in names:
                _finish(engines[a], results[a])
            arms.extend(results.values())
        tail = _measure_tail(policy, cfg)
    return MirrorResult(cfg, policy.describe(), agreement, arms, tail, round_trips, head_loss)


def _measure_tail(policy: BenchPolicy, cfg: MirrorBenchConfig) -> list[ArmResult]:
    """A GRPO-like rollout (groups of samples, heavy-tailed lengths) under ``adaptive``, its arms
    with and without the mirror arms. Sampling is position-keyed (a seed per request): both
    engines emit the same completions, so a pass's ratio is speed alone, not a longer or shorter
    longest sample."""
    prompts = [
        p for p in task_prompts(policy.tokenizer, cfg.tail_prompts, cfg.seed + 1) for _ in range(cfg.tail_samples)
    ]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=cfg.tail_max_new_tokens, noise="position", seed=cfg.seed + i)
        for i in range(len(prompts))
    ]
    n = len(prompts)
    arms = {"adaptive": DEFAULT_ARMS, "adaptive + mirror": (*DEFAULT_ARMS, *TAIL_MIRROR_ARMS)}
    engines = {}
    for name, arm_list in arms.items():
        engine = _engine(policy, name, cfg, n, selector=SelectorConfig(arms=arm_list))
        engine.generate(prompts, params)  # warm-up: the selector's measurements, as an earlier RL step leaves them
        engines[name] = engine
    results = {name: ArmResult(name, n) for name in arms}
    measured = {name: len(engine.stats.step_log) for name, engine in engines.items()}
    _passes(engines, results, lambda e: _run(e, prompts, n, params), cfg.tail_passes, "adaptive")
    for name, engine in engines.items():
        results[name].by_batch = steps_by_batch(list(engine.stats.step_log)[measured[name] :])
        _finish(engine, results[name])
    return list(results.values())


TAIL_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def steps_by_batch(steps) -> dict[int, list[float]]:
    """Decode steps summed by active sequences (the smallest bucket bound at or above them):
    [seconds, tokens emitted, seconds in mirror steps]."""
    out: dict[int, list[float]] = {}
    for step in steps:
        bound = next((b for b in TAIL_BUCKETS if step.num_active <= b), TAIL_BUCKETS[-1])
        row = out.setdefault(bound, [0.0, 0.0, 0.0])
        row[0] += step.seconds
        row[1] += step.emitted
        row[2] += step.seconds if "mirror" in step.strategy else 0.0
    return dict(sorted(out.items()))


def tail_profile_table(result: MirrorResult) -> str:
    """Where the long-tail rollout spends its time, by active sequences, with and without mirror arms."""
    if len(result.tail) < 2:
        return ""
    base, mirror = result.tail[0], result.tail[1]
    total = sum(row[0] for row in base.by_batch.values()) or 1.0
    lines = [
        f"| active sequences | {base.arm}: share of decode time | {base.arm} tok/s | {mirror.arm} tok/s | ratio "
        "| time in mirror steps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lower = 0
    for bound, (seconds, tokens, _) in base.by_batch.items():
        m_seconds, m_tokens, m_mirror = mirror.by_batch.get(bound, [0.0, 0.0, 0.0])
        rate, m_rate = tokens / max(seconds, 1e-9), m_tokens / max(m_seconds, 1e-9)
        lines.append(
            f"| {lower + 1}-{bound} | {seconds / total:.0%} | {rate:.0f} | {m_rate:.0f} | "
            f"{m_rate / max(rate, 1e-9):.2f}x | {m_mirror / max(m_seconds, 1e-9):.0%} |"
        )
        lower = bound
    return "\n".join(lines)


def serial_arm_of(arm: str) -> str | None:
    """The serial arm a mirror arm drafts like (its own drafter, chain and host aside), or None."""
    if "mirror:" not in arm:
        return None
    return arm.split(" @")[0].replace("mirror:", "").rsplit(",k=", 1)[0]


def _same_pass(r: ArmResult, other: ArmResult) -> tuple[float, float, float]:
    """Median, min and max over passes of ``r``'s tok/s over ``other``'s in the same pass."""
    ratios = [(t / s) / (ot / os) for t, s, ot, os in zip(r.tokens, r.seconds, other.tokens, other.seconds)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _ratio_cell(ratio: tuple[float, float, float]) -> str:
    median, low, high = ratio
    return f"{median:.2f}x ({low:.2f}-{high:.2f})" if high > low else f"{median:.2f}x"


def mirror_table(result: MirrorResult) -> str:
    lines = [
        "| batch | arm | tok/s | vs chain:4 (same pass) | vs its serial arm | vs the best serial arm | draft share "
        "| reuse | serial draft ms/step | wait ms/step |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r.batch, r.arm): r for r in result.arms}
    for r in result.arms + result.tail:
        own = by_key.get((r.batch, serial_arm_of(r.arm)))
        serial = [x for x in result.arms if x.batch == r.batch and x.arm in SERIAL_ARMS and x.arm != "none"]
        in_batch_rows = any(r is a for a in result.arms)  # not the long-tail rows
        best = max(serial, key=lambda x: x.ratio) if serial and r.mirror and in_batch_rows else None
        m = r.mirror
        lines.append(
            f"| {r.batch} | {r.arm} | {r.tok_s:.0f} | {_ratio_cell((r.ratio, min(r.ratios), max(r.ratios)))} | "
            f"{_ratio_cell(_same_pass(r, own)) if own is not None else ''} | "
            f"{_ratio_cell(_same_pass(r, best)) + f' ({best.arm})' if best is not None else ''} | "
            f"{r.draft_share:.0%} | "
            + (f"{m['reuse']:.0%} | {m['serial_ms']:.1f} | {m['wait_ms']:.1f} |" if m else "| | |")
        )
    return "\n".join(lines)


def channel_line(result: MirrorResult) -> str:
    """The draft hosts' round trips against what a batch-1 round costs."""
    none = next((r for r in result.arms if r.arm == "none" and r.batch == 1), None)
    forward = f"{1e3 / none.tok_s:.1f} ms" if none is not None else "n/a"
    trips = ", ".join(f"{name} {ms:.2f} ms" for name, ms in result.round_trip_ms.items()) or "n/a"
    return (
        f"**Draft hosts**: an empty command there and back (median of 200): {trips}; one target decode "
        f"step at batch 1 takes {forward}. A mirror step sends one request before its forward and "
        "collects the drafts after it, so the channel costs about one round trip per step; the `@ray` "
        "arm above is the same continuation drafted by a Ray actor (here on this machine: a finished "
        "worker's spare CPU or GPU elsewhere in the cluster would be reached the same way)."
    )


def agreement_table(result: MirrorResult) -> str:
    layers = sorted(result.agreement)
    shown = [layer for layer in layers if layer % 3 == 1 or layer == result.config.exit_layer or layer == layers[-1]]
    head = "| k | " + " | ".join(f"layer {layer}" for layer in shown) + " |"
    rule = "|---|" + "---:|" * len(shown)
    rows = [f"| {k} | " + " | ".join(f"{result.agreement[layer][k]:.0%}" for layer in shown) + " |" for k in (1, 2, 4)]
    return "\n".join([head, rule, *rows])


def plot_mirror(result: MirrorResult, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    batches = result.config.batch_sizes
    arms = [a for a in (*SERIAL_ARMS, *MIRROR_ARMS) if a != "none"]
    width = 0.85 / len(arms)
    colors = plt.get_cmap("tab20").colors
    for i, arm in enumerate(arms):
        ys = [next((r.ratio for r in result.arms if r.arm == arm and r.batch == b), 0.0) for b in batches]
        hatch = "//" if "mirror" in arm else None
        ax.bar([x + i * width for x in range(len(batches))], ys, width, label=arm, color=colors[i % 20], hatch=hatch)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.425 - width / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("tok/s vs serial chain:4 (same pass)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save_figure(fig, path)


def mirror_section(result: MirrorResult, plot_name: str) -> str:
    c = result.config
    base = {r.batch: r for r in result.arms if r.arm == BASELINE}
    bound = ", ".join(f"batch {b}: {r.draft_share:.0%}" for b, r in base.items())
    return (
        f"On {result.describe}, chain-sum prompts, T = {c.temperature}, at most {c.max_new_tokens} new tokens, "
        f"{c.prompts} prompts per batch size (batch 1: one by one), {c.passes} interleaved passes; every arm "
        "its own engine, the target on one torch thread; the mirror arms draft in a process (executor "
        "`process`) on the second core with one thread of its own: the drafter LM's copy catches up from "
        "tokens, the EAGLE-3 head's copy is sent the feature rows of every target forward. "
        f"Early exit after layer {c.exit_layer}. Ratios: "
        "medians of same-pass ratios to serial `chain:4` with the drafter LM (spread in brackets). *Draft "
        "share*: the share of a speculative step spent drafting on the critical path; for serial `chain:4` it "
        f"is the bound of what mirror can take off ({bound}). *Reuse*: rounds whose draft was ready (a branch "
        "matched). *Serial draft ms/step*: drafting left on the critical path per mirror step; *wait*: time "
        "the step waited for the draft process after verification.\n\n"
        f"{mirror_table(result)}\n\n![mirror]({plot_name})\n\n"
        f"**The long-tail rollout** (the batch-{c.tail_prompts * c.tail_samples} rows): {c.tail_prompts} chain-sum "
        f"prompts x {c.tail_samples} samples, at most {c.tail_max_new_tokens} tokens, T = 1 with position-keyed "
        "noise (a seed per request: both engines emit the same completions, so a pass's ratio is speed alone), "
        "`adaptive` over the default arms without and with "
        + ", ".join(f"`{a}`" for a in TAIL_MIRROR_ARMS)
        + f", each selector warmed by one rollout, {c.tail_passes} interleaved passes. Where the measured passes "
        "spent their decode time, by active sequences:\n\n"
        f"{tail_profile_table(result)}\n\n"
        f"{channel_line(result)}\n\n"
        "**Speculative streaming** (`streaming` arms): the drafter LM with one streaming head (two draft "
        "tokens per drafter forward), the head fitted on 48 of the policy's own completions (cross-entropy "
        f"{result.head_loss[0]:.2f} -> {result.head_loss[1]:.2f}; the drafter LM itself is not changed).\n\n"
        "Early exit (the target's own final norm and LM head after layer L, no adapter): how often the "
        "target's next token is in its top k, over greedy completions.\n\n"
        f"{agreement_table(result)}"
    )
