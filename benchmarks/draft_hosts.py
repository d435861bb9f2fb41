"""Mirror-SD across workers: does a worker idle in the tail pay as the draft host of a busy one?

A GRPO-style rollout (groups of samples, heavy-tailed lengths) over 2 Ray workers, each arm its
own coordinator, passes interleaved arm by arm, ratios medians of same-pass ratios:

- ``chain:4``: serial drafting with the drafter LM (the baseline);
- ``mirror inline``: ``mirror:chain:4,k=0`` with nothing beside the target (a worker with no
  spare compute of its own: the mirror step then drafts serially, as on a GPU busy with its target);
- ``mirror inline + draft hosts``: the same, with ``WorkersConfig.draft_hosts``: the worker that
  finishes first drafts the other's branches;
- ``mirror process``: ``mirror:chain:4,k=0`` with a draft process of each worker's own (local
  spare compute, the best case a worker can have by itself).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from ..rollout import RolloutConfig, SamplingParams
from ..workers import RolloutCoordinator, WorkersConfig
from .policies import BenchPolicy, task_prompts
from .report import pyplot, save_figure

logger = logging.getLogger(__name__)

# arm -> (strategy, mirror executor, draft hosts)
ARMS = {
    "chain:4": ("chain:4", "inline", False),
    "mirror inline": ("mirror:chain:4,k=0", "inline", False),
    "mirror inline + draft hosts": ("mirror:chain:4,k=0", "inline", True),
    "mirror process": ("mirror:chain:4,k=0", "process", False),
}
BASELINE = "chain:4"


@dataclass
class DraftHostBenchConfig:
    policy: str = "deep"
    prompts: int = 6  # GRPO groups of ...
    samples: int = 4  # ... samples each
    max_new_tokens: int = 384
    passes: int = 3
    exit_layer: int = 7
    seed: int = 21

    @classmethod
    def quick(cls) -> DraftHostBenchConfig:
        return cls(policy="tiny", prompts=2, samples=2, max_new_tokens=48, passes=1)


@dataclass
class HostArm:
    arm: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    tail_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # same-pass tok/s over the baseline's
    pairs: int = 0  # draft-host pairs made over all passes
    hosted: int = 0  # draft commands the hosts answered
    accept_length: float = 0.0

    @property
    def tok_s(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds))


@dataclass
class DraftHostResult:
    config: DraftHostBenchConfig
    describe: str
    arms: list[HostArm]
    round_trip_ms: float  # an empty draft command to the peer host and back


def _coordinator(policy: BenchPolicy, arm: str, cfg: DraftHostBenchConfig, n: int) -> RolloutCoordinator:
    strategy, executor, hosts = ARMS[arm]
    rollout = RolloutConfig(
        strategy=strategy,
        kv_cache_tokens=max(8192, n * (cfg.max_new_tokens + 256)),
        max_num_seqs=n,
        mirror={"exit_layer": cfg.exit_layer, "executor": executor},
        seed=cfg.seed,
    )
    workers = WorkersConfig(
        num_workers=2,
        num_cpus_per_worker=0.25,  # four coordinators' workers on one 2-CPU Ray: they take turns
        threads_per_worker=1,
        schedule="static",  # one shard each: the first to finish is idle for the rest of the rollout
        spot_training=False,
        draft_hosts=hosts,
    )
    return RolloutCoordinator(
        policy.model, rollout, [policy.tokenizer.eos_token_id], drafter=policy.drafter_lm, config=workers
    )


def _peer_round_trip_ms(coordinator: RolloutCoordinator) -> float:
    """An empty command from one worker's peer executor to the other worker's host, and back."""
    from ..rollout.mirror.hosted import round_trip_s
    from ..workers.draft_hosts import PeerExecutor

    peer = PeerExecutor(coordinator.actors, coordinator.workers[1], pairing=10**9)
    return 1e3 * round_trip_s(peer, repeats=100)


def measure_draft_hosts(cfg: DraftHostBenchConfig) -> DraftHostResult:
    import ray

    policy = BenchPolicy.load(cfg.policy)
    prompts = [p for p in task_prompts(policy.tokenizer, cfg.prompts, cfg.seed) for _ in range(cfg.samples)]
    params = SamplingParams(temperature=1.0, max_new_tokens=cfg.max_new_tokens)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        coordinators = {a: _coordinator(policy, a, cfg, len(prompts)) for a in ARMS}
        results = {a: HostArm(a) for a in ARMS}
        for p in range(cfg.passes):
            for arm, coordinator in coordinators.items():
                start = time.perf_counter()
                report = coordinator.generate(prompts, params)
                r = results[arm]
                r.seconds.append(time.perf_counter() - start)
                r.tokens.append(sum(len(o.completion_ids) for o in report.outputs))
                r.tail_s.append(report.counts.tail_time_s)
                r.accept_length = report.counts.mean_accept_length
                logger.info("draft-host bench pass %d %s: %.2f s, %d tokens", p, arm, r.seconds[-1], r.tokens[-1])
            base = results[BASELINE]
            for r in results.values():
                r.ratios.append((r.tokens[-1] / r.seconds[-1]) / (base.tokens[-1] / base.seconds[-1]))
        for arm, coordinator in coordinators.items():
            results[arm].pairs = sum(1 for e in coordinator.events if e.kind == "draft_host")
            actors = coordinator.actors
            results[arm].hosted = sum(
                actors.get([actors.call(w, "hosted_commands") for w in coordinator.workers.values()])
            )
        round_trip = _peer_round_trip_ms(coordinators[BASELINE])
        for coordinator in coordinators.values():
            coordinator.shutdown()
        return DraftHostResult(cfg, policy.describe(), list(results.values()), round_trip)
    finally:
        ray.shutdown()


def draft_hosts_table(result: DraftHostResult) -> str:
    lines = [
        "| arm | tok/s | vs chain:4 (same pass) | tail s (summed over workers) | accept length | pairs | "
        "commands hosted |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.arms:
        spread = f" ({min(r.ratios):.2f}-{max(r.ratios):.2f})" if len(r.ratios) > 1 else ""
        lines.append(
            f"| {r.arm} | {r.tok_s:.0f} | {statistics.median(r.ratios):.2f}x{spread} | "
            f"{statistics.median(r.tail_s):.1f} | {r.accept_length:.2f} | {r.pairs} | {r.hosted} |"
        )
    return "\n".join(lines)


def plot_draft_hosts(result: DraftHostResult, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r.arm for r in result.arms]
    ax.bar(names, [statistics.median(r.ratios) for r in result.arms], color="tab:blue")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("tok/s vs serial chain:4 (same pass)")
    ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, path)


def draft_hosts_section(result: DraftHostResult, plot_name: str) -> str:
    c = result.config
    return (
        f"On {result.describe}: {c.prompts} chain-sum prompts x {c.samples} samples (T = 1, at most "
        f"{c.max_new_tokens} tokens), 2 Ray workers with one torch thread each, one shard each (`static`), "
        f"the drafter LM, early exit after layer {c.exit_layer}, {c.passes} interleaved passes; every arm "
        "its own coordinator. *mirror inline* has nothing to draft beside its target (as a worker whose "
        "GPU is busy with its target); *+ draft hosts* pairs the worker that finishes first with the one "
        "still decoding, which then drafts its branches there (`WorkersConfig(draft_hosts=True)`); "
        "*mirror process* has a draft process of its own on a spare core. An empty draft command from "
        f"one worker to the other's host and back takes {result.round_trip_ms:.2f} ms (median of 100).\n\n"
        f"{draft_hosts_table(result)}\n\n![draft hosts]({plot_name})"
    )
