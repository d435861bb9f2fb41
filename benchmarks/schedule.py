"""The long tail across workers: static shards vs divided rollout, predicted order and tail
rebalancing, on 2 Ray workers, plus a simulation at 8, 64 and 256 workers calibrated on this
machine and validated against the measured run.

Every request carries its own seed and decodes without speculation, so every arm generates the
very same tokens: the arms differ only in when and where each token is computed.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..rollout import RolloutConfig, RolloutEngine, SamplingParams
from ..rollout.admission import eos_ids_of
from .policies import BenchPolicy, task_prompts, torch_threads
from .report import pyplot, save_figure
from .schedule_sim import ARMS, CostModel, SimRequest, scaled_workload, simulate, tail_seconds

logger = logging.getLogger(__name__)

ARM_SETTINGS = {
    "static": dict(schedule="static", order="fifo", rebalance=False),
    "divided": dict(schedule="divided", order="fifo", rebalance=False),
    "divided+order": dict(schedule="divided", order="predicted", rebalance=False),
    "divided+order+rebalance": dict(schedule="divided", order="predicted", rebalance=True),
}


@dataclass
class ScheduleBenchConfig:
    policy: str = "deep"
    problems: int = 12
    samples: int = 8  # per prompt (a GRPO group)
    max_new_tokens: int = 384
    max_num_seqs: int = 16  # per worker: a KV-limited engine, as memory limits a GPU instance
    passes: int = 3
    sim_workers: tuple[int, ...] = (8, 64, 256)
    seed: int = 7
    budget_ratio: float = 0.5  # the length-aware arm's RolloutConfig.length_budget
    spec_passes: int = 3  # of the two adaptive arms (budget off / on), drafting with the drafter LM

    @classmethod
    def quick(cls) -> ScheduleBenchConfig:
        return cls(problems=4, samples=4, max_new_tokens=96, max_num_seqs=4, passes=1, sim_workers=(8,), spec_passes=1)


@dataclass
class ArmRun:
    arm: str
    makespan: float
    finish_times: list[float]
    idle_share: dict[int, float]
    first_dry: int | None
    moved: int
    length_error: float
    timeline: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # worker -> (t, held)

    @property
    def tail_s(self) -> float:
        return tail_seconds(self.finish_times)


@dataclass
class ScheduleResult:
    config: ScheduleBenchConfig
    runs: dict[str, list[ArmRun]]
    bound_s: float
    longest: int
    lengths: list[int]
    cost: CostModel
    simulated_2: dict[str, float]
    simulated: dict[int, dict[str, float]]
    describe: str
    work_bound_s: float = 0.0  # every token at full batch, spread evenly over the workers
    budget_runs: dict[str, list[ArmRun]] = field(default_factory=dict)  # adaptive, length budget off / on


def _timeline(events, start: float) -> tuple[dict[int, list[tuple[float, int]]], dict[int, float], int | None]:
    """Per worker, (time, requests held) after every change; the busy seconds; the first to run dry."""
    lines: dict[int, list[tuple[float, int]]] = {}
    first_dry = None
    for e in events:
        if e.worker is None or "held" not in e.detail:
            continue
        lines.setdefault(e.worker, [(0.0, 0)]).append((e.time - start, e.detail["held"]))
        if e.detail["held"] == 0 and first_dry is None and e.kind == "finished":
            first_dry = e.worker
    busy = {}
    for w, points in lines.items():
        busy[w] = sum(t1 - t0 for (t0, h), (t1, _) in zip(points, points[1:]) if h > 0)
    return lines, busy, first_dry


def _run_arm(coord, arm: str, prompts, params):
    """One rollout under ``arm``'s settings on the same workers: (its ArmRun, the report)."""
    coord.config = dataclasses.replace(coord.config, **ARM_SETTINGS[arm])
    first_event = len(coord.events)
    start = time.perf_counter()
    report = coord.generate(prompts, params)
    events = coord.events[first_event:]
    lines, busy, first_dry = _timeline(events, start)
    finish = [e.time - start for e in events if e.kind == "finished" for _ in range(e.detail["requests"])]
    return ArmRun(
        arm,
        report.seconds,
        finish,
        {w: max(0.0, 1 - b / report.seconds) for w, b in busy.items()},
        first_dry,
        report.requests_moved,
        report.length_error,
        lines,
    ), report


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def calibrate(model, eos: list[int], max_num_seqs: int, prompts: list[list[int]], context: int = 320) -> CostModel:
    """Decode-step seconds by batch size and context (a line over ``context`` steps at each batch
    size; every sequence has the same prompt length, so a step's context is known), and prefill
    seconds by tokens (one prompt vs eight, fit to a line), measured on ``prompts``."""
    sizes = sorted({1, 2, 4, 8, max_num_seqs} & set(range(1, max_num_seqs + 1)))
    prompt = min(prompts, key=len)
    decode, slopes = [], []
    for b in sizes:
        engine = RolloutEngine(model, RolloutConfig(kv_cache_tokens=1 << 15, max_num_seqs=b), eos_token_ids=eos)
        engine.generate([prompt] * b, SamplingParams(max_new_tokens=context, ignore_eos=True, temperature=1.0))
        steps = [r.seconds for r in engine.stats.step_log if r.num_active == b]
        ctx = [len(prompt) + 1 + i for i in range(len(steps))]
        keep = [i for i in range(len(steps)) if steps[i] < 3 * statistics.median(steps)]  # drop hiccups
        intercept, slope = _line([ctx[i] for i in keep], [steps[i] for i in keep])
        decode.append(intercept + slope * len(prompt))
        slopes.append(max(slope, 0.0))
    prefill, tokens = [], []
    for n in (1, 8):
        engine = RolloutEngine(model, RolloutConfig(kv_cache_tokens=1 << 15), eos_token_ids=eos)
        batch = [prompts[(i * 7) % len(prompts)] for i in range(n)]
        times = []
        for _ in range(5):
            for p in batch:
                engine.add_request(p, SamplingParams(max_new_tokens=1))
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - t0)
        prefill.append(statistics.median(times))
        tokens.append(sum(len(p) for p in batch))
    per_token = max(0.0, (prefill[1] - prefill[0]) / max(1, tokens[1] - tokens[0]))
    fixed = max(0.0, prefill[0] - per_token * tokens[0])
    return CostModel(tuple(sizes), tuple(decode), fixed, per_token, tuple(slopes), len(prompt))


def _simulated(cfg: ScheduleBenchConfig, prompts, lengths: list[int], cost) -> tuple[dict, dict]:
    """Each arm's simulated makespan on the measured workload at 2 workers, and on workloads scaled
    to each of ``cfg.sim_workers`` workers (predicted lengths: each group's mean)."""
    requests = [SimRequest(i, i // cfg.samples, len(prompts[i]), lengths[i]) for i in range(len(prompts))]
    predicted = {g: statistics.mean(lengths[g * cfg.samples : (g + 1) * cfg.samples]) for g in range(cfg.problems)}
    sim2 = {
        arm: simulate(requests, 2, arm, cost, max_num_seqs=cfg.max_num_seqs, predicted=predicted).makespan
        for arm in ARMS
    }
    groups = [lengths[g * cfg.samples : (g + 1) * cfg.samples] for g in range(cfg.problems)]
    prompt_lens = [len(prompts[g * cfg.samples]) for g in range(cfg.problems)]
    simulated = {}
    for n in cfg.sim_workers:
        work = scaled_workload(groups, prompt_lens, num_groups=cfg.problems * n // 2, seed=n)
        pred = {}
        for r in work:
            pred.setdefault(r.group, []).append(r.length)
        pred_mean = {g: statistics.mean(v) for g, v in pred.items()}
        simulated[n] = {
            arm: simulate(work, n, arm, cost, max_num_seqs=cfg.max_num_seqs, predicted=pred_mean).makespan
            for arm in ARMS
        }
    return sim2, simulated


def measure_schedule(cfg: ScheduleBenchConfig) -> ScheduleResult:
    from ..tasks.sft import load_shipped
    from ..workers import RolloutCoordinator, WorkersConfig

    model, tokenizer = load_shipped(cfg.policy, "policy")
    describe = BenchPolicy(cfg.policy, model, tokenizer, None, None).describe()
    eos = sorted(eos_ids_of(model, tokenizer))
    problems = task_prompts(tokenizer, cfg.problems, cfg.seed)
    prompts = [list(p) for p in problems for _ in range(cfg.samples)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed * 100_000 + i)
        for i in range(len(prompts))
    ]
    rollout_config = RolloutConfig(kv_cache_tokens=1 << 15, max_num_seqs=cfg.max_num_seqs)
    coord = RolloutCoordinator(
        model, rollout_config, eos, config=WorkersConfig(num_workers=2, spot_training=False, threads_per_worker=1)
    )
    try:
        warm = coord.generate(prompts, params)  # the previous epoch's rollout: the predictor's history
        runs: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
        for p in range(cfg.passes):
            for arm in ARMS:
                run, report = _run_arm(coord, arm, prompts, params)
                if [o.completion_ids for o in report.outputs] != [o.completion_ids for o in warm.outputs]:
                    raise RuntimeError(f"arm {arm} generated other tokens: a schedule must never change them")
                runs[arm].append(run)
                logger.info("pass %d %s: %.2f s, moved %d", p + 1, arm, run.makespan, run.moved)
    finally:
        coord.shutdown()
    lengths = [len(o.completion_ids) for o in warm.outputs]
    longest = max(range(len(prompts)), key=lambda i: lengths[i])
    with torch_threads(1):
        engine = RolloutEngine(model, rollout_config, eos_token_ids=eos)
        engine.generate([prompts[longest]], [params[longest]])  # warm-up
        t0 = time.perf_counter()
        alone = engine.generate([prompts[longest]], [params[longest]])[0]
        bound = time.perf_counter() - t0
        cost = calibrate(model, eos, cfg.max_num_seqs, [list(p) for p in problems])
    sim2, simulated = _simulated(cfg, prompts, lengths, cost)
    logger.info("bound: request %d (%d tokens) alone %.2f s", longest, len(alone.completion_ids), bound)
    mean_context = statistics.fmean(len(p) + n / 2 for p, n in zip(prompts, lengths))
    per_token = cost.decode(cfg.max_num_seqs, mean_context) / cfg.max_num_seqs
    work_bound = sum(lengths) * per_token / 2
    budget_runs = measure_budget(cfg, model, eos, prompts, params)
    return ScheduleResult(
        cfg, runs, bound, lengths[longest], lengths, cost, sim2, simulated, describe, work_bound, budget_runs
    )


def measure_budget(cfg: ScheduleBenchConfig, model, eos, prompts, params) -> dict[str, list[ArmRun]]:
    """``adaptive`` with the drafter LM under the full schedule, the length-aware draft budget off
    and on (the same workers and warm selectors, passes interleaved)."""
    from ..tasks.sft import load_shipped
    from ..workers import RolloutCoordinator, WorkersConfig

    drafter = load_shipped(cfg.policy, "drafter")[0]
    rollout_config = RolloutConfig(kv_cache_tokens=1 << 15, max_num_seqs=cfg.max_num_seqs, strategy="adaptive")
    workers = WorkersConfig(num_workers=2, spot_training=False, threads_per_worker=1)
    coord = RolloutCoordinator(model, rollout_config, eos, drafter=drafter, config=workers)
    runs: dict[str, list[ArmRun]] = {"adaptive": [], "adaptive + length budget": []}
    try:
        coord.generate(prompts, params)  # warms the selectors (and the predictor)
        for p in range(cfg.spec_passes):
            for name, ratio in (("adaptive", 0.0), ("adaptive + length budget", cfg.budget_ratio)):
                coord.pool.call_all("set_length_budget", ratio)
                run, _ = _run_arm(coord, "divided+order+rebalance", prompts, params)
                runs[name].append(dataclasses.replace(run, arm=name))
                logger.info("pass %d %s: %.2f s", p + 1, name, run.makespan)
    finally:
        coord.shutdown()
    return runs


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _same_pass(reference: list[ArmRun], runs: list[ArmRun]) -> str:
    """Speedup over ``reference``: the median of the same-pass makespan ratios, with their spread."""
    ratios = [ref.makespan / run.makespan for ref, run in zip(reference, runs)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def budget_line(result: ScheduleResult) -> str:
    """The length budget against plain adaptive, pass by pass."""
    runs = result.budget_runs
    if not runs.get("adaptive"):
        return ""
    ratio = _same_pass(runs["adaptive"], runs["adaptive + length budget"])
    return f"The length budget against plain `adaptive`, same-pass median (spread): {ratio}.\n\n"


def schedule_table(result: ScheduleResult) -> str:
    static = _median([r.makespan for r in result.runs["static"]])
    lines = [
        "| arm | makespan s | vs static (median, spread) | vs bound | tail s (last 10%) | idle share per worker | "
        "first dry worker idle | moved | length error | simulated s (error) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for arm, runs in {**result.runs, **result.budget_runs}.items():
        makespan = _median([r.makespan for r in runs])
        if arm in result.runs:  # interleaved with static pass by pass: the median of same-pass ratios
            vs_static = _same_pass(result.runs["static"], runs)
        else:  # another coordinator's passes: a ratio of medians
            vs_static = f"{static / makespan:.2f}x (of medians)"
        idle = {w: _median([r.idle_share.get(w, 1.0) for r in runs]) for w in sorted(runs[0].idle_share)}
        dry = _median([r.idle_share.get(r.first_dry, 0.0) for r in runs if r.first_dry is not None])
        sim = result.simulated_2.get(arm, float("nan"))
        lines.append(
            f"| {arm} | {makespan:.2f} | {vs_static} | {makespan / result.bound_s:.2f}x | "
            f"{_median([r.tail_s for r in runs]):.2f} | "
            + ", ".join(f"w{w} {v:.0%}" for w, v in idle.items())
            + f" | {dry:.0%} | {_median([r.moved for r in runs]):.0f} | "
            f"{_median([r.length_error for r in runs]):.0%} | "
            + (f"{sim:.2f} ({sim / makespan - 1:+.0%}) |" if sim == sim else "n/a |")
        )
    return "\n".join(lines)


def simulation_table(result: ScheduleResult) -> str:
    lines = [
        "| workers | requests | " + " | ".join(ARMS) + " | best vs static |",
        "|---:|---:|" + "---:|" * (len(ARMS) + 1),
    ]
    for n, by_arm in result.simulated.items():
        static = by_arm["static"]
        best = min(by_arm.values())
        requests = result.config.problems * n // 2 * result.config.samples
        lines.append(
            f"| {n} | {requests} | " + " | ".join(f"{by_arm[a]:.2f}" for a in ARMS) + f" | {static / best:.2f}x |"
        )
    return "\n".join(lines)


def plot_schedule(result: ScheduleResult, path: Path) -> None:
    plt = pyplot()
    arms = ["static", "divided+order+rebalance"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, arm in zip(axes, arms):
        run = result.runs[arm][-1]
        for w, points in sorted(run.timeline.items()):
            ts, held = zip(*points)
            ax.step(list(ts) + [run.makespan], list(held) + [held[-1]], where="post", label=f"worker {w}")
        ax.axvline(result.bound_s, color="gray", linestyle=":", label="bound (longest alone)")
        ax.set_title(f"{arm}: {run.makespan:.1f} s")
        ax.set_xlabel("seconds into the rollout")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("requests held")
    save_figure(fig, path)


def schedule_section(result: ScheduleResult, plot_name: str) -> str:
    c = result.config
    cost = result.cost
    decode = ", ".join(f"{b}: {s * 1e3:.1f}" for b, s in zip(cost.decode_batch, cost.decode_s))
    return (
        f"A GRPO-like rollout on {result.describe}: {c.problems} chain-sum prompts x {c.samples} samples, T = 1, "
        f"at most {c.max_new_tokens} new tokens, no speculation, every request with its own seed, so every arm "
        "generates the very same tokens (checked) and differs only in when and where each is computed. 2 Ray "
        f"workers (one CPU and one torch thread each), each engine holding at most {c.max_num_seqs} sequences "
        "(a KV-limited instance, as GPU memory limits one). One warm-up rollout first (the previous epoch: the "
        f"length predictor's history), then {c.passes} pass(es) of the arms, interleaved; medians. *static*: one "
        "shard per worker, prompt groups together (the old behaviour); *divided*: a global queue of 4-request "
        "chunks pulled as workers have room; *+order*: longest-predicted first (after one probe per unknown "
        "prompt); *+rebalance*: a worker that runs dry takes every second request of the busiest one (re-prefilled "
        "on CPU). *Bound*: the longest request "
        f"({result.longest} tokens) decoded alone at batch 1: {result.bound_s:.2f} s; no schedule can beat it. "
        f"Nor can one beat the *work bound*: all {sum(result.lengths):,} tokens decoded at full batch "
        f"({c.max_num_seqs} per worker), evenly over the 2 workers: {result.work_bound_s:.2f} s. *Idle*: share of "
        "the rollout a worker held no request (spot training off here). *Length error*: mean |predicted - actual| "
        "/ actual at dispatch. The last two rows run `adaptive` (the drafter LM as the model drafter, warm "
        f"selectors) under the full schedule, the length-aware draft budget off and on (ratio {c.budget_ratio}: "
        "in a speculative step only sequences expected to run at least that share of the batch's longest "
        f"draft), {c.spec_passes} interleaved passes; with speculation at T = 1 each pass draws other "
        "completions (as likely), so these two rows are not token-identical to the rest.\n\n"
        f"{schedule_table(result)}\n\n{budget_line(result)}![schedule]({plot_name})\n\n"
        f"**Simulation** (`benchmarks/schedule_sim.py`): the same dealing and rebalancing rules over workers "
        f"that each cost what this machine measured (decode step ms by batch size: {decode}; prefill "
        f"{cost.prefill_fixed_s * 1e3:.1f} ms + {cost.prefill_per_token_s * 1e6:.0f} us per token), "
        "validated above against the measured 2-worker run (*simulated s*). Bigger clusters get proportionally "
        "more prompt groups (the same per-worker load), drawn from the measured groups with their lengths.\n\n"
        f"{simulation_table(result)}"
    )
