"""Stage ``speed``: tokens/s on a policy of realistic size, built with no hub.

The shipped deep policy (24 x 256) is grown to about 1B parameters without changing its function
(``tasks/grow.py``; checked here on the device), so the shipped drafter LM keeps its real
acceptance on it. Every contender decodes the same prompts greedily (the long-tail rollout samples
with position-keyed noise, so every strategy emits the same completions); each engine runs once to
capture its graphs and compile its kernels, then once timed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ...kernels.dispatch import KERNELS, resolve_backend
from ...rollout.adaptive.cost_model import batch_bucket
from ...rollout.engine import RolloutEngine
from ...rollout.model.graph_pool import capture_seconds, uncaptured_runs
from ...rollout.params import RolloutConfig, SamplingParams
from ...rollout.stats import StepRecord
from ...tasks.grow import grow_policy
from ...tasks.sft import load_shipped
from ..goodput import goodput_by_bucket
from .common import Stage, device, graph_backend, mirror_config, timed
from .env import copy_bandwidth_gbs
from .models import task_prompts

SPEC_STRATEGIES = ("chain:4", "adaptive", "mirror:chain:4,k=0")
# every speculative contender: its strategy and the RolloutConfig fields it runs with
SPEC_CONTENDERS = {s: (s, {}) for s in SPEC_STRATEGIES}
# chain:4 (launched from state on the device) / none (issue targets, the median of same-pass ratios)
DEVICE_CHAIN_TARGETS = {1: 2.6, 16: 1.8, 64: 1.6}
# a decode step's anatomy (wall against device busy, the host's CUDA calls): these arms at
# ``CheckSize.anatomy_batches``, in ``CheckSize.anatomy_passes`` interleaved passes (``step_anatomy``)
ANATOMY = (("none", "none", {}), ("chain:4", "chain:4", {}), ("tree:4,2,8", "tree:4,2,8", {}))


def count_tokens(rows: list[list[int]], eos: int) -> int:
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


class Contenders:
    """Engines kept across batch sizes (their graph pools and selectors warm), plus HF ``generate``."""

    def __init__(
        self, policy, drafter, tokenizer, max_num_seqs: int = 256, kv_cache_tokens: int = RolloutConfig.kv_cache_tokens
    ) -> None:
        self.policy, self.drafter, self.tokenizer = policy, drafter, tokenizer
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.engines: dict[tuple[str, str, str, bool, bool], RolloutEngine] = {}
        self.eos = tokenizer.eos_token_id

    def engine(
        self,
        strategy: str,
        graphs: str,
        kernels: str = "auto",
        compile: bool = False,
        merge_projections: bool = False,
    ) -> RolloutEngine:
        key = (strategy, graphs, kernels, compile, merge_projections)
        if key not in self.engines:
            config = RolloutConfig(
                strategy=strategy,
                graph_backend=graphs,
                kernels=kernels,
                compile=compile,
                merge_projections=merge_projections,
                max_num_seqs=self.max_num_seqs,
                kv_cache_tokens=self.kv_cache_tokens,
                mirror=mirror_config(),
            )
            drafter = None if strategy == "none" else self.drafter
            self.engines[key] = RolloutEngine(self.policy, config, tokenizer=self.tokenizer, drafter=drafter)
        return self.engines[key]

    def engine_rate(self, strategy: str, graphs: str, prompts, params, warm_prompts, **engine_fields) -> dict:
        """Timed on ``prompts`` after a run on as many other prompts (graphs captured, kernels compiled,
        the selector measured): other prompts, so no drafter has seen the timed completions.
        ``engine_fields``: :meth:`engine`'s keyword arguments."""
        engine = self.engine(strategy, graphs, **engine_fields)
        if warm_prompts:  # a later pass of the same shapes may go without
            engine.generate(warm_prompts, params)
        before, captured_before, uncaptured_before = engine.stats.as_dict(), capture_seconds(), uncaptured_runs()
        steps_before, logged_before = dict(engine.stats.strategy_steps), len(engine.stats.step_log)
        outs, seconds = timed(lambda: engine.generate(prompts, params))
        timed_steps = list(engine.stats.step_log)[logged_before:]
        after, captured = engine.stats.as_dict(), capture_seconds() - captured_before
        tokens = sum(len(o.completion_ids) for o in outs)
        steps = after["decode_steps"] - before["decode_steps"]
        pool = engine.runner.graph_pool
        return {
            "tok_s": tokens / seconds,
            "tokens": tokens,
            "seconds": seconds,
            "decode_step_ms": 1000 * (after["decode_time_s"] - before["decode_time_s"]) / max(1, steps),
            "accepted_per_spec_step": _accept_length(before, after),
            # a speculative step's anatomy: drafting, the target's verification forward, the rest
            # (sampling, acceptance, bookkeeping); per spec step, in ms
            **_step_anatomy(before, after),
            "captures": pool.stats.captures if pool is not None else 0,
            # graphs captured during the timed run (target and drafter pools): shapes the warm-up
            # did not reach, e.g. an adaptive arm first tried on this batch size
            "capture_s_timed": captured,
            # forwards without a graph in the timed run (every pool): past the largest bucket, or a
            # mirror draft thread's shapes the owner had not captured (run 15: mirror's verification
            # took 2-3x chain:4's at batch 16 and 64)
            "uncaptured_timed": uncaptured_runs() - uncaptured_before,
            # adaptive: the timed run's strategy mix, and what the selector predicts per bucket
            "strategy_steps": {
                k: v - steps_before.get(k, 0)
                for k, v in engine.stats.strategy_steps.items()
                if v > steps_before.get(k, 0)
            },
            "selector_state": engine.selector.state_dict() if engine.selector is not None else None,
            # the timed steps per batch-size bucket: tokens, seconds, steps and arms
            "buckets": {b: asdict(g) for b, g in goodput_by_bucket(timed_steps, BUCKETS).items()},
            "selector_check": selector_check(engine, timed_steps) if engine.selector is not None else None,
            "completions": [o.completion_ids for o in outs],
        }

    @torch.no_grad()
    def hf_rate(self, prompts, params, static: bool = False) -> dict:
        """HF ``generate``, greedy on left-padded batches: eager with its dynamic cache, or with
        ``static`` its static cache, which transformers compiles (torch.compile) on a GPU: its
        fastest own path. The static one warms up at the timed shapes (its compile is not timed)."""
        dev = next(self.policy.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)

        def generate(max_new_tokens: int):
            return self.policy.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=self.eos,
                pad_token_id=pad,
                **({"cache_implementation": "static"} if static else {}),
            )

        generate(params.max_new_tokens if static else 4)  # warm
        out, seconds = timed(lambda: generate(params.max_new_tokens))
        tokens = count_tokens(out[:, width:].tolist(), self.eos)
        return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def _step_anatomy(before: dict, after: dict) -> dict:
    """Per speculative step of the timed run: ms drafting and verifying, and (when every decode
    step speculated) the rest of the step: sampling, acceptance, bookkeeping."""
    delta = {
        k: after[k] - before[k]
        for k in ("spec_steps", "decode_steps", "draft_time_s", "verify_time_s", "decode_time_s")
    }
    steps = delta["spec_steps"]
    if not steps:
        return {}
    draft, verify = 1000 * delta["draft_time_s"] / steps, 1000 * delta["verify_time_s"] / steps
    anatomy = {"draft_ms": round(draft, 3), "verify_ms": round(verify, 3)}
    if delta["decode_steps"] == steps:
        anatomy["rest_ms"] = round(1000 * delta["decode_time_s"] / steps - draft - verify, 3)
    return anatomy


def _accept_length(before: dict, after: dict) -> float | None:
    steps = after["spec_seq_steps"] - before["spec_seq_steps"]
    emitted = after["spec_emitted_tokens"] - before["spec_emitted_tokens"]
    return round(emitted / steps, 3) if steps else None


def grow(stage: Stage, dev: torch.device, dtype: torch.dtype, prompts, source: torch.nn.Module | None = None):
    """The grown policy in ``dtype``, from ``source`` (the shipped deep policy by default); its
    function is checked in fp32 against the source's first."""
    deep = source if source is not None else load_shipped("deep", "policy")[0]
    size = stage.size
    grown = grow_policy(
        deep,
        hidden_size=size.grown_hidden,
        intermediate_size=size.grown_intermediate,
        num_layers=size.grown_layers,
        device=dev,
        dtype=torch.float32,
    )
    deep = deep.to(dev)
    worst, agree, total = 0.0, 0, 0
    with torch.no_grad():
        for p in prompts[:4]:
            ids = torch.tensor([p], device=dev)
            a, b = deep(ids).logits[0].float(), grown(ids).logits[0].float()
            worst = max(worst, float((a - b).abs().max()))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
    params = sum(p.numel() for p in grown.parameters())
    stage.record(
        "grown_policy",
        {
            "parameters": params,
            "hidden": size.grown_hidden,
            "layers": size.grown_layers,
            "intermediate": size.grown_intermediate,
            "fp32_max_logit_diff": worst,
            "argmax_agreement": f"{agree}/{total}",
        },
    )
    stage.check(
        "grown policy computes its source's function (fp32)",
        worst < 1e-3 and agree == total,
        f"{params / 1e9:.2f}B parameters, max logit diff {worst:.1e}, argmax {agree}/{total}",
    )
    return grown.to(dtype).eval()


def replay_ms(engine: RolloutEngine, repeats: int = 50) -> float | None:
    """One replay of the batch-1 decode graph alone (what the step costs without the engine around it)."""
    pool = engine.runner.graph_pool
    key = next((k for k in pool.keys() if (k.batch, k.tokens) == (1, 1)), None) if pool is not None else None
    if key is None or not torch.cuda.is_available() or not pool.replay(key):
        return None
    _, seconds = timed(lambda: [pool.replay(key) for _ in range(repeats)])
    return 1000 * seconds / repeats


def replay_profile(engine: RolloutEngine, rows: int = 15) -> dict:
    """Where one replay of the batch-1 decode graph spends its time: kernels by total device time."""
    from torch.profiler import ProfilerActivity, profile

    pool = engine.runner.graph_pool
    key = next(k for k in pool.keys() if (k.batch, k.tokens) == (1, 1))
    pool.replay(key)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pool.replay(key)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    busy_us = sum(e.device_time_total for e in events)
    return {"kernels": len(events), "kernel_time_ms": busy_us / 1000, "table": table}


def step_profile(engine: RolloutEngine, prompts, params, rows: int = 20, python: bool = True) -> dict:
    """Where a decode step's wall time goes beyond the replays (run 11: a batch-1 step 0.74 ms
    longer than its replay; run 12: 2.0 ms on the 7.2B policy, and ``chain:4``'s drafting 10 ms):
    one ``generate`` (warmed up) under the torch profiler, host and device, and under cProfile.
    Per decode step (the generate's wall time and device time over its decode steps, its prefill
    included): wall ms, device-busy ms, and the host's CUDA calls (copies, launches, graph
    launches, syncs); the host ops by self time; the Python functions by own time (``python``:
    one more generate, under cProfile)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    engine.generate(prompts, params)
    steps_before = engine.stats.decode_steps
    with profile(activities=activities) as prof:
        outs, seconds = timed(lambda: engine.generate(prompts, params))
    steps = max(1, engine.stats.decode_steps - steps_before)
    events = prof.events()
    device_us = sum(e.device_time_total for e in events if e.device_type.name == "CUDA")
    calls = (
        "cudaMemcpyAsync",
        "cudaLaunchKernel",
        "cudaGraphLaunch",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",  # a step's one wait, at the commit of the step before it
        "cudaMemsetAsync",
    )
    per_step = {c: round(sum(e.name == c for e in events) / steps, 1) for c in calls}
    text = io.StringIO()
    if python:
        profiler = cProfile.Profile()
        profiler.enable()
        engine.generate(prompts, params)
        profiler.disable()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return {
        "decode_steps": steps,
        "wall_ms_per_step": round(1000 * seconds / steps, 3),
        "device_busy_ms_per_step": round(device_us / 1000 / steps, 3),
        "cuda_calls_per_step": per_step,
        "host_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows),
        "python": text.getvalue()[-6000:],
        "tokens": sum(len(o.completion_ids) for o in outs),
    }


def decode_floor_ms(model, context: int, copy_gbs: float) -> tuple[float, int]:
    """The batch-1 decode step's floor: every weight and the context's K/V read once, at the copy rate."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    kv = context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * element
    return 1000 * (weights + kv) / (copy_gbs * 1e9), weights + kv


@dataclass
class SpeedRun:
    """What the stage's parts share: the contenders, the prompts, the rows measured so far (recorded
    as each one lands) and the headline figures."""

    stage: Stage
    contenders: Contenders
    graphs: str
    prompts: list
    warm: list
    greedy: SamplingParams
    rows: list[dict] = field(default_factory=list)
    headline: dict[str, str] = field(default_factory=dict)
    anatomy: dict[tuple[str, int], list[dict]] = field(default_factory=dict)  # (arm, batch) -> step profiles
    label: str = ""  # put before its contenders' names and headline keys (a second policy's run shares rows)

    def add(self, row: dict) -> None:
        """Record ``row``; it supersedes an earlier row of its contender and batch (a contender timed
        again in passes beside others)."""
        kept = {**{k: v for k, v in row.items() if k != "completions"}, "contender": self.name(row["contender"])}
        key = (kept["contender"], kept["batch"])
        self.rows = [r for r in self.rows if (r["contender"], r["batch"]) != key] + [kept]
        self.stage.record("rates", self.rows)

    def name(self, what: str) -> str:
        return f"{self.label}{what}"

    def measure(self, name: str, batch: int, rate) -> None:
        with self.stage.part(f"{name} batch {batch}", 8) as ok:
            if ok:
                self.add({"contender": name, "batch": batch, **rate()})

    def ratio(self, a: tuple, b: tuple) -> float | None:
        rate = {(r["contender"], r["batch"]): r for r in self.rows}
        a, b = (self.name(a[0]), a[1]), (self.name(b[0]), b[1])
        return round(rate[a]["tok_s"] / rate[b]["tok_s"], 2) if a in rate and b in rate else None

    def engine_rate(self, strategy: str, batch: int, graphs: str | None = None, first: int = 0, **engine):
        """A timed run of ``strategy`` on ``batch`` prompts from the ``first``-th (a pass's own)."""
        rows = slice(first, first + batch)
        return lambda: self.contenders.engine_rate(
            strategy, graphs or self.graphs, self.prompts[rows], self.greedy, self.warm[rows], **engine
        )

    def in_passes(self, batch: int, rates: dict[str, Callable[[int], dict]], passes: int) -> dict[str, dict[int, dict]]:
        """Each contender's ``rates[name](pass)`` in ``passes`` passes, the order rotating each pass
        (no contender always runs right after the same other one): name -> pass -> its timed run.
        A pass whose part was skipped (the budget) or failed has no entry. The rows recorded are
        each contender's median pass, with every pass's tokens/s."""
        names = list(rates)
        runs: dict[str, dict[int, dict]] = {name: {} for name in names}
        for p in range(passes):
            for name in names[p % len(names) :] + names[: p % len(names)]:
                label = self.name(f"{name} batch {batch}") + (f" pass {p + 1}" if passes > 1 else "")
                with self.stage.part(label, 8) as ok:
                    if ok:
                        runs[name][p] = rates[name](p)
        for name, by_pass in runs.items():
            if by_pass:
                ordered = sorted(by_pass.values(), key=lambda r: r["tok_s"])
                median_pass = ordered[(len(ordered) - 1) // 2]  # a real run: its anatomy, its buckets
                passes_tok_s = {"tok_s_passes": [round(by_pass[q]["tok_s"], 1) for q in sorted(by_pass)]}
                tok_s = statistics.median(r["tok_s"] for r in ordered)
                self.add({**median_pass, "contender": name, "batch": batch, "tok_s": tok_s, **passes_tok_s})
        return runs


def same_pass_ratio(a: dict[int, dict], b: dict[int, dict]) -> str | None:
    """``a``'s tokens/s over ``b``'s, pass by pass: the median and, over several passes, the spread."""
    ratios = [a[p]["tok_s"] / b[p]["tok_s"] for p in sorted(a.keys() & b.keys())]
    if not ratios:
        return None
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} passes)" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}{spread}"


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def selector_check(engine: RolloutEngine, steps: list[StepRecord]) -> list[dict]:
    """``adaptive``'s prediction against what its timed steps measured, per arm and batch-size
    bucket it ran: the median step ms of each, the prediction at the bucket's median batch (the
    selector's state after the run) and, for every arm, the predicted ms and tokens a
    sequence-step at that batch, so a long tail's choices can be judged arm by arm."""
    selector, rows = engine.selector, []
    groups: dict[tuple[str, int], list[StepRecord]] = {}
    for record in steps:
        groups.setdefault((record.strategy, batch_bucket(record.num_active)), []).append(record)
    for (arm, bucket), records in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        n = int(statistics.median(r.num_active for r in records))
        predictions = {str(p.arm): p for p in selector.predictions(n, 100 * n, optimism=0.0)}
        rows.append(
            {
                "arm": arm,
                "bucket": "1" if bucket == 0 else f"{1 << bucket}-{(2 << bucket) - 1}",  # the selector's
                "steps": len(records),
                "n": n,
                "measured_ms": round(1000 * statistics.median(r.seconds for r in records), 3),
                "predicted_ms": round(1000 * predictions[arm].seconds, 3) if arm in predictions else None,
                "tokens_per_seq_step": round(sum(r.emitted for r in records) / sum(r.num_active for r in records), 3),
                "arms_predicted": {
                    a: [round(1000 * p.seconds, 3), round(p.expected, 3)] for a, p in predictions.items()
                },
            }
        )
    return rows


def start_speed_run(stage: Stage, seed: int) -> tuple[SpeedRun, torch.nn.Module, float] | None:
    """What a speed stage starts from: the grown policy (checked; None when it could not be grown),
    the shipped drafter LM, prompts and warm-up prompts from ``seed``, and the copy bandwidth."""
    dev = device()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    drafter, tokenizer = load_shipped("deep", "drafter", dtype=dtype)  # the policy is grown in grow()
    prompts = task_prompts(tokenizer, max(stage.size.speed_batches), seed=seed)
    warm = task_prompts(tokenizer, max(stage.size.speed_batches), seed=seed + 1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=stage.size.max_new_tokens)
    with stage.part("grow", 20) as ok:
        if not ok:
            return None
        policy = grow(stage, dev, dtype, prompts)
    contenders = Contenders(policy, drafter.to(dev), tokenizer, kv_cache_tokens=stage.size.kv_cache_tokens)
    speed = SpeedRun(stage, contenders, graph_backend(), prompts, warm, greedy)
    copy_gbs = copy_bandwidth_gbs(1 << 30 if cuda else 1 << 26)
    stage.record("copy_gbs", round(copy_gbs, 1))
    return speed, policy, copy_gbs


def run(stage: Stage) -> None:
    kernels = {k: resolve_backend(device(), kernel=k) for k in KERNELS}
    stage.record("kernels", kernels)
    if not torch.cuda.is_available():
        stage.skip("CUDA graphs, bf16", "needs CUDA: the eager bucket backend and fp32 stand in")
    started = start_speed_run(stage, seed=21)
    if started is None:
        return
    speed, policy, copy_gbs = started
    other_kernels = "torch" if kernels["attention"] == "triton" else "triton"
    plain_decoding(speed, other_kernels)
    bandwidth_floor(speed, policy, copy_gbs)
    stage.record("headline", speed.headline)
    # before the speculation parts: the budget ran out before it at the end (runs 7 and 9)
    with stage.part("profile of the batch-1 decode graph", 10, cuda_only=True) as ok:
        if ok:
            stage.record("batch1_replay_profile", replay_profile(speed.contenders.engine("none", speed.graphs)))
    # whether the device stays busy through the host's part of a step (wall = busy)
    # batch 1's first pass before the speculation parts, every other pass and batch after the long
    # tail, on what the stage's budget leaves (the headline ratios come first)
    step_anatomy(speed, [(0, 1)])
    speculation(speed, other_kernels)
    long_tail(stage, speed.contenders, speed.contenders.tokenizer, speed.graphs, speed.add, speed.headline)
    passes = range(stage.size.anatomy_passes)
    later = [(p, b) for p in passes for b in stage.size.anatomy_batches if (p, b) != (0, 1)]
    step_anatomy(speed, later)
    stage.record("headline", speed.headline)
    speed.contenders.close()


def step_anatomy(speed: SpeedRun, plan: list[tuple[int, int]]) -> None:
    """Each :data:`ANATOMY` arm's decode step profiled (:func:`step_profile`) for every ``(pass,
    batch)`` of ``plan``, in that order (the Python profile in pass 0 only). Profiles accumulate in
    ``speed.anatomy``; the headline gives each (arm, batch)'s median wall and device-busy ms per
    step over the passes so far, the record every pass's profile."""
    stage = speed.stage
    for p, batch in plan:
        for name, strategy, fields in ANATOMY:
            with stage.part(f"profile of a batch-{batch} {name} step, pass {p + 1}", 10) as ok:
                if ok:
                    engine = speed.contenders.engine(strategy, speed.graphs, **fields)
                    runs = speed.anatomy.setdefault((name, batch), [])
                    runs.append(step_profile(engine, speed.prompts[:batch], speed.greedy, python=p == 0))
    for (name, batch), runs in speed.anatomy.items():
        stage.record(f"step_profile {name} batch {batch}", runs)
        wall = statistics.median(r["wall_ms_per_step"] for r in runs)
        busy = statistics.median(r["device_busy_ms_per_step"] for r in runs)
        speed.headline[f"batch-{batch} {name} step: wall / device busy"] = (
            f"{wall:.2f} / {busy:.2f} ms ({100 * busy / wall:.0f}% busy; median of {len(runs)} passes); "
            f"per step {runs[0]['cuda_calls_per_step']}"
        )


def plain_decoding(speed: SpeedRun, other_kernels: str) -> None:
    """No speculation at every batch size: the engine with graphs and eager, HF ``generate`` and the
    engine with the other attention kernels; the graph contenders in passes at batch 1 and at the
    largest batch (whose target a single run left in doubt in run 15); the headline ratios
    against their targets."""
    largest = max(speed.stage.size.speed_batches)
    for batch in speed.stage.size.speed_batches:
        graphs = {"none graphs": lambda p, b=batch: speed.engine_rate("none", b)()}
        name = f"none graphs kernels={other_kernels}"
        if other_kernels == "triton" and not torch.cuda.is_available():
            speed.stage.skip(f"{name} batch {batch}", "needs CUDA (Triton's interpreter times nothing)")
        else:
            graphs[name] = lambda p, b=batch: speed.engine_rate("none", b, kernels=other_kernels)()
        passes = speed.stage.size.tail_passes if batch in (1, largest) else 1
        speed.in_passes(batch, graphs, passes)
        speed.measure("none eager", batch, speed.engine_rate("none", batch, graphs="none"))
        speed.measure("HF generate", batch, lambda b=batch: speed.contenders.hf_rate(speed.prompts[:b], speed.greedy))
    b64 = 64 if 64 in speed.stage.size.speed_batches else largest
    speed.headline["graphs / eager, batch 1 (target >= 3x)"] = str(speed.ratio(("none graphs", 1), ("none eager", 1)))
    speed.headline["none / HF generate, batch 1 (target >= 5x)"] = str(
        speed.ratio(("none graphs", 1), ("HF generate", 1))
    )
    speed.headline[f"none / HF generate, batch {b64} (target >= 2x)"] = str(
        speed.ratio(("none graphs", b64), ("HF generate", b64))
    )
    row = next((r for r in speed.rows if (r["contender"], r["batch"]) == (speed.name("none graphs"), largest)), None)
    if row is not None:
        passes = ", ".join(f"{x:,.0f}" for x in row["tok_s_passes"])
        speed.headline[f"none tok/s, batch {largest} (median; passes)"] = f"{row['tok_s']:,.0f} ({passes})"


def bandwidth_floor(speed: SpeedRun, policy, copy_gbs: float) -> None:
    """The batch-1 decode step and the graph replay alone against the bytes a step must read."""
    rows = {r["contender"]: r for r in speed.rows if r["batch"] == 1}
    if "none graphs" not in rows:
        return
    context = len(speed.prompts[0]) + speed.stage.size.max_new_tokens // 2
    floor, nbytes = decode_floor_ms(policy, context, copy_gbs)
    step = rows["none graphs"]["decode_step_ms"]
    replay = replay_ms(speed.contenders.engine("none", speed.graphs))
    measured = {"step_ms": step, "replay_ms": replay}
    speed.stage.record("decode_floor", {"bytes_per_step": nbytes, "floor_ms": floor, **measured})
    if replay is not None:
        speed.headline["batch-1 graph replay alone / floor"] = f"{replay / floor:.1f}x ({replay:.2f} ms)"
    speed.headline["batch-1 decode step / bandwidth floor (target <= 2x)"] = f"{step / floor:.1f}x ({step:.2f} ms)"


def speculation(speed: SpeedRun, other_kernels: str) -> None:
    """Every speculative strategy against ``none`` at the speculative batch sizes (with the seconds
    each spent capturing graphs inside its timed run, and where a step's time went); ``chain:4``
    at batch 1 also with the other attention kernels. Batch 1, where a timed run is 6 steps and
    one stall moves it (run 15: 1.75x against run 14's 2.40x), runs in interleaved passes on a
    prompt of each pass's own, ``none`` among them, and its ratios are the same-pass ones."""
    size = speed.stage.size
    for batch in size.spec_batches:
        passes = size.batch1_passes if batch == 1 else 1
        rates: dict[str, Callable[[int], dict]] = {}
        if passes > 1:
            rates["none graphs"] = lambda p: speed.engine_rate("none", 1, first=p)()
        for name, (strategy, fields) in SPEC_CONTENDERS.items():  # p > 0 at batch 1
            rates[name] = lambda p, s=strategy, b=batch, f=fields: speed.engine_rate(s, b, first=p, **f)()
        if batch == 1 and (other_kernels != "triton" or torch.cuda.is_available()):
            rates[f"chain:4 kernels={other_kernels}"] = lambda p: speed.engine_rate(
                "chain:4", 1, first=p, kernels=other_kernels
            )()
        runs = speed.in_passes(batch, rates, passes)
        for strategy in rates:
            if strategy == "none graphs":
                continue
            target = ""
            if strategy == "chain:4" and batch in DEVICE_CHAIN_TARGETS:
                target = f" (target >= {DEVICE_CHAIN_TARGETS[batch]}x)"
            paired = same_pass_ratio(runs[strategy], runs["none graphs"]) if "none graphs" in runs else None
            _headline_ratio(speed, strategy, batch, f"{strategy} / none, batch {batch}{target}", paired)
        speed.stage.record("headline", speed.headline)


def _headline_ratio(speed: SpeedRun, contender: str, batch: int, title: str, paired: str | None = None) -> None:
    """``contender`` against ``none`` at ``batch`` in the headline (``paired``: the same-pass ratio,
    where both ran in passes), with the seconds its (median) timed run spent capturing graphs and
    where its speculative steps' time went (when measured)."""
    row = next((r for r in speed.rows if r["contender"] == contender and r["batch"] == batch), {})
    notes = []
    if row.get("capture_s_timed", 0) >= 0.01:
        notes.append(f"{row['capture_s_timed']:.2f} s capturing in the timed run")
    if row.get("uncaptured_timed"):
        notes.append(f"{row['uncaptured_timed']} forwards without a graph")
    if "draft_ms" in row:
        notes.append(f"a step: draft {row['draft_ms']:.2f} ms, verify {row['verify_ms']:.2f} ms")
    ratio = paired if paired is not None else str(speed.ratio((contender, batch), ("none graphs", batch)))
    speed.headline[title] = ratio + (f" ({'; '.join(notes)})" if notes else "")


def bucket_summary(runs: dict[str, dict]) -> str:
    """Per batch-size bucket of the timed steps: every contender's decode tokens/s there, and
    ``adaptive``'s arms (steps): where a selector lost or won against the fixed arms."""
    parts = []
    for bucket in BUCKETS:
        cells = []
        for name, run in runs.items():
            g = run.get("buckets", {}).get(bucket)
            if g and g["seconds"]:
                cells.append(f"{name} {g['tokens'] / g['seconds']:,.0f}")
        arms = runs.get("adaptive", {}).get("buckets", {}).get(bucket, {}).get("arms", {})
        if cells:
            mix = ", ".join(f"{a} {k}" for a, k in sorted(arms.items(), key=lambda kv: -kv[1]))
            parts.append(f"<={bucket}: " + ", ".join(cells) + (f" [adaptive ran {mix}]" if mix else ""))
    return "; ".join(parts)


def long_tail(stage: Stage, contenders: Contenders, tokenizer, graphs: str, add, headline: dict) -> None:
    """A sampled rollout whose lengths vary as RL rollouts do (T = 1, position-keyed noise), in
    passes of fresh prompts and seeds (the first after a warm-up rollout), the contenders' order
    rotating: the ratios are the median of the same-pass ones, with their spread; the per-bucket
    rates and ``adaptive``'s predictions are its last pass's (its selector the most measured)."""
    size = stage.size
    n = size.long_tail_prompts
    contenders_of = {"none": ("none", {}), **SPEC_CONTENDERS}
    strategies = list(contenders_of)
    runs: dict[str, dict[int, dict]] = {s: {} for s in strategies}
    same = dict.fromkeys(strategies, 0)
    for p in range(size.tail_passes):
        prompts = task_prompts(tokenizer, n, seed=33 + 2 * p)
        warm = task_prompts(tokenizer, n, seed=34) if p == 0 else []
        params = [
            SamplingParams(temperature=1.0, max_new_tokens=2 * size.max_new_tokens, noise="position", seed=s)
            for s in range(1000 + n * p, 1000 + n * (p + 1))
        ]
        for strategy in strategies[p % len(strategies) :] + strategies[: p % len(strategies)]:
            label = f"long tail {strategy}" + (f" pass {p + 1}" if size.tail_passes > 1 else "")
            with stage.part(label, 10) as ok:
                if ok:
                    kind, fields = contenders_of[strategy]
                    runs[strategy][p] = contenders.engine_rate(kind, graphs, prompts, params, warm, **fields)
        if p in runs["none"]:
            plain = runs["none"][p]["completions"]
            for strategy, by_pass in runs.items():
                if p in by_pass:
                    same[strategy] += sum(a == b for a, b in zip(by_pass[p]["completions"], plain))
    tail = {s: by_pass[max(by_pass)] for s, by_pass in runs.items() if by_pass}  # each one's last pass
    for strategy, by_pass in runs.items():
        if by_pass:
            tok_s = statistics.median(r["tok_s"] for r in by_pass.values())
            passes = [round(by_pass[q]["tok_s"], 1) for q in sorted(by_pass)]
            row = {**tail[strategy], "contender": f"long tail {strategy}", "batch": n, "tok_s": tok_s}
            add({**row, "tok_s_passes": passes})
    if not runs["none"]:
        return
    stage.record("long_tail_identical_to_none", {**same, "of": n * len(runs["none"])})
    # fp32 is exact; in bf16 a batch's composition moves logits by rounding, which can flip a
    # near-tie of the perturbed logits: reported, and checked only in fp32
    if next(contenders.policy.parameters()).dtype == torch.float32:
        stage.check("long tail: every strategy emits the same completions", min(same.values()) == same["none"])
    for strategy, by_pass in runs.items():
        if by_pass:
            target = " (target >= 2.0x)" if strategy == "chain:4" else ""
            headline[f"long tail {strategy} / none{target}"] = same_pass_ratio(by_pass, runs["none"])
    fixed = [s for s in ("chain:4", "mirror:chain:4,k=0") if runs.get(s)]
    if runs.get("adaptive") and fixed:
        median_tok_s = {s: statistics.median(r["tok_s"] for r in runs[s].values()) for s in fixed}
        best = max(fixed, key=median_tok_s.get)
        adaptive = runs["adaptive"]
        captured = sum(r["capture_s_timed"] for r in adaptive.values())
        seconds = sum(r["seconds"] for r in adaptive.values())
        headline["long tail adaptive / best fixed (target >= 0.97)"] = (
            f"{same_pass_ratio(adaptive, runs[best])} (best fixed: {best}; "
            f"{captured:.2f} s of its {seconds:.2f} s captured graphs)"
        )
        headline["long tail by batch bucket, decode tok/s (last pass)"] = bucket_summary(tail)
        if tail["adaptive"].get("selector_check"):
            headline["long tail adaptive, predicted / measured step ms (last pass)"] = "; ".join(
                f"{r['arm']}@{r['bucket']} x{r['steps']}: {r['predicted_ms']}/{r['measured_ms']}"
                for r in tail["adaptive"]["selector_check"]
            )
