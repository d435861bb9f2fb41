"""``tailspec bench``: run the benchmarks on the shipped tiny-task policy and write the report."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..rollout.params import RolloutConfig, SamplingParams
from ..tasks.sft import count_parameters, load_tiny, load_tiny_eagle3
from .adaptive import (
    bucket_weighted,
    long_tail_table,
    measure_long_tail,
    measure_uniform,
    oracle_bound,
    plot_adaptive,
    same_pass_table,
)
from .atts import ATTS_TITLE, ATTSBenchConfig, atts_section, atts_table, measure_atts, plot_atts
from .draft_hosts import (
    DraftHostBenchConfig,
    draft_hosts_section,
    draft_hosts_table,
    measure_draft_hosts,
    plot_draft_hosts,
)
from .drift import DriftBenchConfig, drift_section, drift_table, measure_drift, plot_drift, shift_table
from .e2e import e2e_section, e2e_table, measure_e2e, plot_e2e
from .eagle3 import eagle3_table, measure_eagle3, measure_head_cost, plot_eagle3
from .kernels import NO_CUDA_SECTION, kernels_section, run_kernel_bench
from .mirror import MirrorBenchConfig, measure_mirror, mirror_section, mirror_table, plot_mirror
from .policies import BenchPolicy, task_prompts, torch_threads
from .report import plot_throughput, replace_section, throughput_table
from .schedule import ScheduleBenchConfig, measure_schedule, plot_schedule, schedule_section, schedule_table
from .speculative import (
    forward_cost_table,
    measure_forward_cost,
    measure_speculative,
    plot_speculative,
    speculative_table,
)
from .spot_training import measure_spot_training, plot_spot, spot_section, spot_table
from .sweep import Arm, best_ratio, measure_sweep, plot_sweep, sweep_table
from .throughput import measure_throughput

logger = logging.getLogger(__name__)


SPOT_TITLE = "Spot drafter training on Ray workers"
E2E_TITLE = "GRPO end to end: stock TRL vs tailspec"
ORACLE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)  # batch-size buckets the per-bucket oracle picks an arm for
ADAPTIVE_TITLE = "Adaptive strategy selection on a long-tail rollout"


def _rewrite_section(out: Path, quick: bool, title: str, name: str, runs, plot, section, table) -> str:
    """Plot ``runs``, write their ``title`` section of ``out`` in place, return their table."""
    plot_name = f"bench_{name}.png"
    plot(runs, out.parent / plot_name)
    command = f"tailspec bench --section {name}" + (" --quick" if quick else "")
    replace_section(out, title, section(runs, plot_name), command)
    return table(runs)


def run_e2e_section(out: Path, quick: bool = False, seed: int = 0) -> str:
    """Only the end-to-end GRPO comparison, written into ``out`` in place."""
    runs = measure_e2e(3 if quick else 10, seed=seed, quick=quick)
    return _rewrite_section(out, quick, E2E_TITLE, "e2e", runs, plot_e2e, e2e_section, e2e_table)


def adaptive_title(policy: str, drafter: str = "eagle3") -> str:
    title = ADAPTIVE_TITLE if policy == "tiny" else f"{ADAPTIVE_TITLE}: {policy} policy"
    return title if drafter == "eagle3" else f"{title}, drafter LM"


def run_adaptive_section(
    out: Path, quick: bool = False, seed: int = 1234, policy: str = "tiny", threads: int = 1, drafter: str = "eagle3"
) -> str:
    """Only the long-tail adaptive comparison on ``policy`` with ``drafter``, written into ``out`` in place."""
    torch.manual_seed(seed)
    bench = BenchPolicy.load(policy)
    params = SamplingParams(temperature=1.0, max_new_tokens=384)
    command = f"tailspec bench --section adaptive --policy {policy} --drafter {drafter}" + (" --quick" if quick else "")
    with torch_threads(threads):  # the section's machine line then names the threads it was measured with
        body, table = long_tail_section(bench, params, out.parent, quick, seed, drafter)
        replace_section(out, adaptive_title(policy, drafter), body, command)
    return table


SWEEP_TITLE = "Batch-size sweep: every drafter against plain decoding"
SWEEP_ARMS = (
    Arm("none", "none"),
    Arm("chain:2, EAGLE-3", "chain:2", "eagle3"),
    Arm("chain:4, EAGLE-3", "chain:4", "eagle3"),
    Arm("tree:4,2,8, EAGLE-3", "tree:4,2,8", "eagle3"),
    Arm("chain:3, drafter LM", "chain:3", "lm"),
    Arm("chain:4, drafter LM", "chain:4", "lm"),
    Arm("tree:4,2,8, drafter LM", "tree:4,2,8", "lm"),
)


def run_sweep_section(out: Path, quick: bool = False, seed: int = 1234, policy: str = "deep", threads: int = 1) -> str:
    """Every arm against ``none`` at batch 1, 4 and 16 on ``policy`` (interleaved passes), in place."""
    body, table = sweep_section(policy, out.parent, quick, seed, threads)
    command = f"tailspec bench --section sweep --policy {policy}" + (" --quick" if quick else "")
    with torch_threads(threads):  # the section's machine line names the threads it was measured with
        replace_section(out, sweep_title(policy), body, command)
    return table


def sweep_title(policy: str) -> str:
    return f"{SWEEP_TITLE}: {policy} policy"


def sweep_section(policy: str, docs: Path, quick: bool, seed: int, threads: int = 1) -> tuple[str, str]:
    """The sweep's report section (body, table) on ``policy``."""
    bench = BenchPolicy.load(policy)
    params = SamplingParams(temperature=1.0, max_new_tokens=384)
    prompts = task_prompts(bench.tokenizer, 64, seed + 5)
    warmup = task_prompts(bench.tokenizer, 2, seed + 1)
    per_size = {1: 3, 4: 4, 16: 16} if quick else {1: 12, 4: 16, 16: 32}
    drafters = {"eagle3": bench.head, "lm": bench.drafter_lm}
    with torch_threads(threads):
        cells = measure_sweep(
            bench.model,
            drafters,
            SWEEP_ARMS,
            prompts,
            warmup,
            params,
            (1, 4, 16),
            per_size,
            [bench.tokenizer.eos_token_id],
            passes=2 if quick else 3,
        )
    plot_name = f"bench_sweep_{policy}.png"
    plot_sweep(cells, docs / plot_name)
    table = sweep_table(cells)
    best = [(name, best_ratio(cells, 1, key)) for name, key in (("EAGLE-3 head", "eagle3"), ("drafter LM", "lm"))]
    best_line = "; ".join(f"{name}: `{c.arm.strategy}` {c.ratio:.2f}x" for name, c in best if c is not None)
    body = (
        f"Target: {bench.describe()}; drafters: its EAGLE-3 head and its drafter LM ("
        f"{count_parameters(bench.drafter_lm) / 1e6:.1f}M parameters). Chain-sum prompts "
        f"at T = 1.0, at most {params.max_new_tokens} new tokens, {threads} torch thread(s). Each arm is one "
        f"engine per batch size making {2 if quick else 3} passes over the same prompts ({per_size[1]}, "
        f"{per_size[4]} and {per_size[16]} prompts at batch 1, 4 and 16), interleaved with the others pass by "
        f"pass; *vs none* is "
        f"the median of the same-pass ratios of tokens/s, with their smallest and largest. *step ms* splits a "
        f"decode step into drafting, the target's forward (for speculative arms: the verification forward) "
        f"and the rest (sampling, acceptance, KV bookkeeping). Best at batch 1: {best_line}.\n\n"
        f"{table}\n\n![sweep]({plot_name})"
    )
    return body, table


def run_spot_training_section(out: Path, quick: bool = False, seed: int = 0) -> str:
    """Only the spot-training comparison (a GRPO run twice), written into ``out`` in place."""
    runs = measure_spot_training(3 if quick else 8, workers=2, seed=seed, quick=quick)
    return _rewrite_section(out, quick, SPOT_TITLE, "spot_training", runs, plot_spot, spot_section, spot_table)


DRIFT_TITLE = "The drafter and a moving policy: frozen vs online heads"
DRIFT_LM_TITLE = "The drafter LM and a moving policy: frozen vs distilled online"


def run_drift_section(out: Path, quick: bool = False, policy: str = "deep", drafter: str = "eagle3") -> str:
    """Only the drift comparison (a GRPO run per arm, then the format shift), written into ``out`` in
    place: the EAGLE-3 head's arms, or with ``drafter="small_lm"`` the drafter LM's (own section)."""
    base = DriftBenchConfig.quick() if quick else DriftBenchConfig()
    cfg = dataclasses.replace(base, policy=policy, drafter=drafter)
    runs, shift = measure_drift(cfg)
    lm = drafter == "small_lm"
    return _write_policy_section(
        out,
        quick,
        policy,
        "drift_lm" if lm else "drift",
        DRIFT_LM_TITLE if lm else DRIFT_TITLE,
        lambda path: plot_drift(runs, path),
        lambda plot: drift_section(runs, cfg, plot, shift),
        drift_table(runs) + ("\n\n" + shift_table(runs) if shift is not None else ""),
    )


def _write_policy_section(out: Path, quick: bool, policy: str, name: str, title: str, plot, section, table: str):
    """Plot to ``bench_<name>_<policy>.png``, write the section (titled by policy unless deep) in
    place with the command that measured it, return ``table``."""
    plot_name = f"bench_{name}_{policy}.png"
    plot(out.parent / plot_name)
    command = f"tailspec bench --section {name} --policy {policy}" + (" --quick" if quick else "")
    replace_section(out, title + ("" if policy == "deep" else f": {policy} policy"), section(plot_name), command)
    return table


MIRROR_TITLE = "Mirror speculative decoding: drafting beside the target"


def run_mirror_section(out: Path, quick: bool = False, policy: str = "deep") -> str:
    """Only the mirror comparison (serial vs mirror arms by batch size, and a long-tail rollout)."""
    cfg = dataclasses.replace(MirrorBenchConfig.quick() if quick else MirrorBenchConfig(), policy=policy)
    result = measure_mirror(cfg)
    return _write_policy_section(
        out,
        quick,
        policy,
        "mirror",
        MIRROR_TITLE,
        lambda path: plot_mirror(result, path),
        lambda plot: mirror_section(result, plot),
        mirror_table(result),
    )


DRAFT_HOSTS_TITLE = "Mirror-SD across workers: an idle worker drafts for a busy one"


def run_draft_hosts_section(out: Path, quick: bool = False, policy: str = "deep") -> str:
    """Only the cross-worker draft-host comparison (2 Ray workers), written into ``out`` in place."""
    cfg = dataclasses.replace(DraftHostBenchConfig.quick() if quick else DraftHostBenchConfig(), policy=policy)
    result = measure_draft_hosts(cfg)
    return _write_policy_section(
        out,
        quick,
        policy,
        "draft_hosts",
        DRAFT_HOSTS_TITLE,
        lambda path: plot_draft_hosts(result, path),
        lambda plot: draft_hosts_section(result, plot),
        draft_hosts_table(result),
    )


SCHEDULE_TITLE = "The long tail across workers: divided rollout, predicted order, rebalancing"


def run_schedule_section(out: Path, quick: bool = False, policy: str = "deep") -> str:
    """Only the schedule comparison (2 Ray workers and the simulation), written into ``out`` in place."""
    cfg = dataclasses.replace(ScheduleBenchConfig.quick() if quick else ScheduleBenchConfig(), policy=policy)
    result = measure_schedule(cfg)
    return _write_policy_section(
        out,
        quick,
        policy,
        "schedule",
        SCHEDULE_TITLE,
        lambda path: plot_schedule(result, path),
        lambda plot: schedule_section(result, plot),
        schedule_table(result),
    )


def write_atts_section(out: Path, rows, calibration, cfg: ATTSBenchConfig, command: str) -> None:
    plot_name = atts_plot_name(cfg)
    plot_atts(rows, out.parent / plot_name)
    replace_section(out, atts_title(cfg), atts_section(rows, calibration, cfg, plot_name), command)


def atts_title(cfg: ATTSBenchConfig) -> str:
    title = ATTS_TITLE if cfg.policy == "tiny" else f"{ATTS_TITLE}: {cfg.policy} policy"
    if cfg.max_num_seqs != ATTSBenchConfig.max_num_seqs:
        title += f", at most {cfg.max_num_seqs} sequences per engine"
    return title


def atts_plot_name(cfg: ATTSBenchConfig) -> str:
    policy = "" if cfg.policy == "tiny" else f"_{cfg.policy}"
    concurrency = "" if cfg.max_num_seqs == ATTSBenchConfig.max_num_seqs else f"_{cfg.max_num_seqs}seqs"
    return f"bench_atts{policy}{concurrency}.png"


def run_atts_section(out: Path, quick: bool = False, policy: str = "tiny") -> str:
    """Only the ATTS comparisons (engines as Ray actors) on ``policy``, written into ``out`` in place."""
    tables = []
    for cfg in _atts_bench_configs(quick, policy):
        rows, calibration = measure_atts(cfg)
        command = f"tailspec bench --section atts --policy {policy}" + (" --quick" if quick else "")
        write_atts_section(out, rows, calibration, cfg, command)
        tables.append(atts_table(rows))
    return "\n\n".join(tables)


# The deep target is also measured with few sequences per engine: there a CPU decodes memory-bound,
# as a GPU target does at the batch sizes a rollout runs (a step costs about the same for 1 token
# as for a chunk of 32), which is the regime ATTS's scoring prefills are built for.
MEMORY_BOUND_SEQS = 4


def _atts_bench_configs(quick: bool, policy: str = "tiny") -> list[ATTSBenchConfig]:
    base = dataclasses.replace(ATTSBenchConfig.quick() if quick else ATTSBenchConfig(), ray=True, policy=policy)
    if policy == "tiny":
        return [base]
    return [base, dataclasses.replace(base, max_num_seqs=MEMORY_BOUND_SEQS)]


THROUGHPUT_TITLE = "Rollout throughput: tailspec engine vs HF generate"
SPECULATIVE_TITLE = "Speculative decoding: strategies vs no speculation"
EAGLE3_TITLE = "EAGLE-3 head: before and after online training"
KERNELS_TITLE = "Triton kernels"
TINY_WORKLOAD = (
    "Target: the shipped tiny policy (4 layers, where speculation cannot pay on a CPU); chain-sum prompts with "
    "heavy-tailed answer lengths, T = 1.0, at most 384 new tokens, seed {seed}.\n\n"
)


def _command(name: str, quick: bool) -> str:
    return f"tailspec bench --section {name}" + (" --quick" if quick else "")


def _tiny_policy(seed: int):
    """The shipped tiny policy, its tokenizer, the sampling parameters and 64 task prompts."""
    torch.manual_seed(seed)
    model, tokenizer = load_tiny("policy")
    return model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=384), task_prompts(tokenizer, 64, seed)


def run_throughput_section(out: Path, quick: bool = False, seed: int = 1234) -> str:
    """The engine (no speculation) against HF ``generate`` at batch 1, 8 and 32, in place."""
    model, tokenizer, params, prompts = _tiny_policy(seed)
    per_size = {1: 4, 8: 16, 32: 32} if quick else {1: 16, 8: 32, 32: 64}
    results = measure_throughput(
        model,
        prompts,
        params,
        (1, 8, 32),
        per_size,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        engine_config=RolloutConfig(),
        repeats=1 if quick else 2,
    )
    table = throughput_table(results)
    plot_throughput(results, out.parent / "bench_throughput.png")
    body = TINY_WORKLOAD.format(seed=seed) + (
        "HF `generate` is called on left-padded batches exactly as `trl.GRPOTrainer` does without "
        "vLLM; tailspec runs the same batches through its engine (no speculation). "
        "Best of the repeats for each backend.\n\n"
        f"{table}\n\n![throughput](bench_throughput.png)"
    )
    replace_section(out, THROUGHPUT_TITLE, body, _command("throughput", quick))
    return table


def run_speculative_section(out: Path, quick: bool = False, seed: int = 1234) -> str:
    """Every strategy against no speculation on the tiny policy, in place."""
    model, tokenizer, params, prompts = _tiny_policy(seed)
    body, table = speculative_section(model, tokenizer, prompts, params, out.parent, quick, seed)
    replace_section(out, SPECULATIVE_TITLE, TINY_WORKLOAD.format(seed=seed) + body, _command("speculative", quick))
    return table


def run_eagle3_section(out: Path, quick: bool = False, seed: int = 1234) -> str:
    """A fresh EAGLE-3 head before and after online training on the tiny policy, in place."""
    model, tokenizer, params, _ = _tiny_policy(seed)
    body, table = eagle3_section(model, tokenizer, params, out.parent, quick, seed)
    replace_section(out, EAGLE3_TITLE, TINY_WORKLOAD.format(seed=seed) + body, _command("eagle3", quick))
    return table


def run_kernels_section(out: Path, quick: bool = False, seed: int = 1234) -> str:
    """The Triton kernels against their references on CUDA (a note saying why not elsewhere), in place."""
    model, tokenizer, _, _ = _tiny_policy(seed)
    body = kernels_section_for_this_machine(model, tokenizer, quick)
    replace_section(out, KERNELS_TITLE, body, _command("kernels", quick))
    return body


def kernels_section_for_this_machine(model, tokenizer, quick: bool) -> str:
    """The kernel benchmark on CUDA (a copy of the policy and the shipped head moved to the GPU);
    a note saying why not elsewhere."""
    if not torch.cuda.is_available():
        return NO_CUDA_SECTION
    import copy

    device = torch.device("cuda")
    policy = copy.deepcopy(model).to(device)
    head = load_tiny_eagle3().to(device)
    prompts = task_prompts(tokenizer, 64, seed=0)
    timings, engine = run_kernel_bench(device, policy, prompts, [tokenizer.eos_token_id], head, quick)
    return kernels_section(timings, engine, torch.cuda.get_device_name(0))


SPEC_STRATEGIES = ("none", "chain:2", "chain:4", "tree:4,2,8", "suffix", "suffix:8")


def speculative_section(
    model, tokenizer, prompts, params: SamplingParams, docs: Path, quick: bool, seed: int
) -> tuple[str, str]:
    """Strategies side by side at batch 1, 4 and 16: distinct prompts, and GRPO-style groups."""
    drafter, _ = load_tiny("drafter")
    eos = [tokenizer.eos_token_id]
    warmup = task_prompts(tokenizer, 2, seed + 1)
    per_size = {1: 4, 4: 8, 16: 16} if quick else {1: 12, 4: 16, 16: 32}
    results = measure_speculative(
        model, drafter, prompts, warmup, params, (1, 4, 16), SPEC_STRATEGIES, per_size, eos, workload="distinct prompts"
    )
    results += measure_speculative(
        model,
        drafter,
        prompts,
        warmup,
        params,
        (16,),
        SPEC_STRATEGIES,
        {16: 16 if quick else 32},
        eos,
        workload="GRPO groups of 8",
        group_size=8,
    )
    plot_speculative(results, docs / "bench_speculative.png")
    table = speculative_table(results)
    costs = forward_cost_table(measure_forward_cost(model, "policy") + measure_forward_cost(drafter, "drafter"))
    body = (
        "Target: the shipped tiny policy; drafter LM: the shipped tiny drafter (8x fewer parameters); "
        "the suffix drafter needs no model. Each cell is a fresh engine (warmed up on other prompts) "
        "generating the same batches at T = 1.0; `vs none` divides by the no-speculation row of the "
        "same workload and batch size. *Mean accepted length* is tokens emitted per sequence per "
        "speculative step (accepted drafts + the target's own token); *draft s* / *verify s* split "
        "the time of the speculative steps. *GRPO groups of 8*: each batch of 16 is 2 prompts x 8 "
        "samples, as `GRPOTrainer` repeats them, so the suffix drafter can draft from siblings.\n\n"
        f"{table}\n\n![speculative](bench_speculative.png)\n\n"
        "**What bounds the speedup here.** Speculation pays when a forward over a few extra tokens "
        "costs about the same as over one (memory-bound decoding, as on a GPU with a real model) "
        "and drafting is cheap. On this CPU neither holds for 3M-parameter models: the batch-1 "
        "forward cost grows with the number of query tokens, and the drafter LM, though 8x "
        "smaller, costs a large share of a target forward because per-layer framework overhead "
        "dominates at this size. Median batch-1 forward over 64 cached tokens:\n\n"
        f"{costs}"
    )
    return body, table


def eagle3_section(model, tokenizer, params: SamplingParams, docs: Path, quick: bool, seed: int) -> tuple[str, str]:
    """A fresh EAGLE-3 head at batch 1, trained online on the policy's rollouts, measured again."""
    drafter, _ = load_tiny("drafter")
    rounds, steps = (1, 20) if quick else (3, 150)
    train = task_prompts(tokenizer, 24 if quick else 192, seed + 2)
    held_out = task_prompts(tokenizer, 4 if quick else 12, seed + 3)
    warmup = task_prompts(tokenizer, 2, seed + 1)
    bench = measure_eagle3(
        model,
        drafter,
        train,
        held_out,
        warmup,
        params,
        [tokenizer.eos_token_id],
        rounds=rounds,
        steps_per_round=steps,
        seed=seed,
        shipped=load_tiny_eagle3(),
    )
    plot_eagle3(bench, docs / "bench_eagle3.png")
    table = eagle3_table(bench)
    from ..drafter.eagle3 import Eagle3Config, Eagle3Head

    head_ms = measure_head_cost(model, Eagle3Head(Eagle3Config.for_target(model.config))).ms
    target_ms = {c.query_tokens: c.ms for c in measure_forward_cost(model, "policy", query_tokens=(1, 6))}
    drafter_ms = measure_forward_cost(drafter, "drafter", query_tokens=(1,))[0].ms
    costs = (
        f"Median batch-1 costs over 64 cached tokens: target forward {target_ms[1]:.2f} ms (1 token) and "
        f"{target_ms[6]:.2f} ms (6 tokens, verifying a 5-token chain); EAGLE-3 head row {head_ms:.2f} ms "
        f"({head_ms / target_ms[1]:.0%} of a target step); drafter LM step {drafter_ms:.2f} ms "
        f"({drafter_ms / target_ms[1]:.0%})."
    )
    rollout_rows = "\n".join(
        f"| {r.round} | {r.completions} | {r.tokens} | {r.accept_length:.2f} | {r.loss_first:.3f} -> {r.loss_last:.3f} "
        f"| {r.train_s:.0f} |"
        for r in bench.rounds
    )
    body = (
        f"The head (one decoder layer over the inputs of policy layers {list(bench.aux_layer_ids)} "
        f"plus `fc`, `lm_head` over the full vocabulary) starts from random init and is trained by the "
        f"warm-up recipe: {rounds} round(s), each rolling out {len(train) // rounds} training prompts "
        f"(features and top-8 soft labels are recorded from the engine's own target forwards, no extra "
        f"pass; from round 2 on the rollouts already speculate with the head) and then taking {steps} "
        f"AdamW steps of the training-time-test loss (4 unrolled steps). Acceptance and speed are "
        f"measured at batch 1 on {len(held_out)} held-out prompts, T = 1.0.\n\n{table}\n\n"
        "| round | completions | tokens | their accept length | loss | train s |\n|---:|---:|---:|---:|---|---:|\n"
        f"{rollout_rows}\n\n![eagle3](bench_eagle3.png)\n\n{costs} "
        "A chain of k drafts costs k head rows (one catch-up row, then k - 1 chained rows) plus one "
        "verification; with the head at that share of a target step, the speedup at batch 1 is bounded "
        "well below the accepted length. The head is one decoder layer of a 4-layer target here; on a "
        "28-layer target it is about 1/28 of the compute, and on a GPU the per-step overhead that "
        "dominates these CPU numbers is what CUDA graphs remove."
    )
    return body, table


DRAFTER_NAMES = {"eagle3": "the shipped EAGLE-3 head", "lm": "the shipped drafter LM"}


def long_tail_section(
    bench: BenchPolicy, params: SamplingParams, docs: Path, quick: bool, seed: int, drafter: str = "eagle3"
) -> tuple[str, str]:
    """One GRPO-sized rollout with a long tail: adaptive vs every fixed strategy vs none vs HF generate,
    with ``drafter`` (``eagle3`` or ``lm``) as the model drafter."""
    model, tokenizer = bench.model, bench.tokenizer
    head = bench.head if drafter == "eagle3" else bench.drafter_lm
    eos = [tokenizer.eos_token_id]
    prompts = task_prompts(tokenizer, 16 if quick else 64, seed + 4)
    params = params.with_updates(noise="position", seed=seed)  # every engine emits the same completions a round
    results = measure_long_tail(model, head, prompts, params, eos, tokenizer.pad_token_id)
    adaptive = [r for r in results if r.name.startswith("adaptive")]
    paired = same_pass_table(results)
    plot_name = "bench_adaptive.png" if bench.name == "tiny" else f"bench_adaptive_{bench.name}.png"
    plot_name = plot_name if drafter == "eagle3" else plot_name.replace(".png", f"_{drafter}.png")
    plot_adaptive(adaptive[-1], docs / plot_name)
    uniform = measure_uniform(model, head, prompts, params.with_updates(max_new_tokens=64 if quick else 128), eos)
    table = long_tail_table(results)
    uniform_table = long_tail_table(uniform)
    bounds = ORACLE_BUCKETS
    oracle = oracle_bound(results, bounds)
    weighted = bucket_weighted(results, bounds)
    weighted_table = "\n".join(
        ["| run | decode s, `none`'s tokens per bucket | vs none |", "|---|---:|---:|"]
        + [f"| {name} | {s:.2f} | {weighted['none'] / s:.2f}x |" for name, s in weighted.items()]
    )
    lengths = sorted(len(p) for p in prompts)
    body = (
        f"{len(prompts)} chain-sum prompts in one `generate` call (one GRPO rollout's worth), "
        f"{bench.describe()}, {torch.get_num_threads()} torch thread(s), T = 1.0, "
        f"max_new_tokens = {params.max_new_tokens}; the model drafter is {DRAFTER_NAMES[drafter]}, attached "
        f"only to the runs that can draft with it (with a head attached, every target "
        f"forward taps its features, so `none` and `suffix` run without one). Completion lengths are "
        f"heavy-tailed, so the batch drains into a tail of a few long "
        f"sequences (*tail s*: decode time with at most 25% of the wave's peak still active). `adaptive` "
        f"picks an arm per step (`none`, `chain:2`, `chain:4`, `tree:4,2,8`, `suffix`, `hybrid:4,2,12`) by "
        f"the least predicted time for the batch's remaining tokens (step costs calibrated when the engine "
        f"starts, acceptance pooled per drafter); *cold* is a fresh selector, *warm* the same engine's "
        f"second call, as the next RL step finds it. T = 1 sampling with position-keyed noise: every token "
        f"is an exact sample of the policy's distribution and every engine emits the same completions on "
        f"the same prompts and seeds, so all share one long tail. Every contender makes 3 passes, round by "
        f"round (round r: every contender on workload r, the same prompts and seeds), so that the "
        f"machine's speed drift hits them alike; adaptive's cold pass runs first, on a workload of its "
        f"own. Prompt lengths {lengths[0]}-{lengths[-1]} tokens.\n\n"
        f"{table}\n\n**Same-round ratios** (the fixed arm's seconds over `adaptive (warm)`'s on the "
        f"same completions; > 1: adaptive was faster), median and spread over the rounds:\n\n"
        f"{paired}\n\n![adaptive]({plot_name})\n\n"
        f"**Per batch-size bucket** (decode steps of every pass): goodput of each "
        f"run, and the fixed arm that was best there. No selector over these arms can beat the best fixed "
        f"arm of every bucket: decoding the no-speculation run's tokens of each bucket at that bucket's best "
        f"goodput takes {oracle.oracle_decode_s:.2f} s against its {oracle.none_decode_s:.2f} s, a bound of "
        f"**{oracle.speedup:.2f}x** over no speculation for any per-bucket choice on this machine with these "
        f"drafters (prefill, the same for all, left out).\n\n{oracle.table}\n\n"
        f"**Weighted by the same tokens per bucket.** Decoding the no-speculation run's tokens of every "
        f"bucket at each run's own goodput there takes:\n\n{weighted_table}\n\n"
        f"**Uniform lengths, full batch** ({len(prompts)} sequences, every one exactly "
        f"{64 if quick else 128} tokens, EOS ignored): where speculation cannot pay, adaptive should cost "
        f"nothing.\n\n{uniform_table}"
    )
    return body, f"{table}\n\n{paired}\n\n{uniform_table}"
