"""Stage ``fast_path``: the engine's decoding against the hardware and against
transformers' own fastest path, on each decoder path (``VARIANTS``).

The decoder paths: the layers eager; compiled (``RolloutConfig.compile``: Inductor fuses the
norms, QKV epilogue, RoPE and the new K/V rows before the paged attention, and o_proj's residual
add, the norm and the MLP's activation after it); compiled with merged projections
(``RolloutConfig.merge_projections``: QKV and gate-up one GEMM each). On the grown 1.0B policy
(``speed.grow``), batch sizes of the pack's speed stage:

* ``none`` with CUDA graphs on each path, in ``CheckSize.fast_path_passes`` interleaved passes
  (the order rotating), median and spread of the same-pass ratio to the eager layers; the same
  completions or not (bf16 fusions round differently, so a near-tie may flip: reported; in fp32,
  the CPU rehearsal, checked: CI's check that Inductor's generated code decodes as the eager layers do);
* kernels per batch-1 decode step and their device time on each path (the profile of one graph
  replay), and the step against its bandwidth floor;
* ``chain:4`` with the drafter LM on each path at batch 1;
* transformers' static cache (compiled by transformers on a GPU) at batch 1;
* the same three parts at batch 1 on a policy of Llama-3-8B's shape (7.2B parameters), where
  reading the weights dominates (the issue's target: within 1.4x its floor);
* batch-1 decoding after long prompts (2k, 8k, 32k tokens: RL reasoning rollouts), with each
  attention path (gather + SDPA, the split-KV Triton kernel), against the floor that reads every
  weight and the context's K/V once. Last: a 32k prefill may run out of memory.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from ...kernels.dispatch import resolve_backend
from ...rollout.engine import RolloutEngine
from ...rollout.params import RolloutConfig, SamplingParams
from ...tasks.grow import grow_policy
from ...tasks.sft import load_shipped
from .common import Stage, device, timed
from .speed import (
    Contenders,
    SpeedRun,
    decode_floor_ms,
    replay_ms,
    replay_profile,
    same_pass_ratio,
    start_speed_run,
)

LONG_CONTEXT_NEW = 32  # tokens decoded after a long prompt (ignore_eos: every context decodes as many)


def run(stage: Stage) -> None:
    """The engine's targets first (a lease's one call leaves this stage what the others left: the
    parts that do not fit are skipped by name, and ``make gpu-speed`` runs the whole stage): plain
    decoding at batch 1 and at the largest batch on every decoder path, the batch-1 replay's kernels,
    the 7.2B policy; then the other batch sizes, ``chain:4`` on each path, transformers' static cache
    and the long contexts."""
    started = start_speed_run(stage, seed=41)
    if started is None:
        return
    speed, policy, copy_gbs = started
    batches = stage.size.speed_batches
    first = (min(batches), max(batches))
    compiled_against_eager(speed, "none", first)
    kernels_per_step(speed, policy, copy_gbs)
    big_policy(speed, copy_gbs)
    compiled_against_eager(speed, "none", [b for b in batches if b not in first])
    compiled_against_eager(speed, "chain:4", (1,))
    hf_static_cache(speed)
    speed.contenders.close()
    long_contexts(speed, policy, copy_gbs, resolve_backend(device(), kernel="attention"))


# the engine's decoder paths: (name, the row suffix, RolloutConfig fields)
VARIANTS = (
    ("eager layers", "", {}),
    ("compiled", " compile", {"compile": True}),
    ("compiled + merged", " compile merged", {"compile": True, "merge_projections": True}),
)


# and at the largest batch on a GPU, where attention weighs most: the eager layers with the other
# attention path than ``auto``'s split-KV kernel (gather + SDPA), the batch-256 target's other contender
OTHER_ATTENTION = ("eager layers, gather + SDPA", " kernels=torch", {"kernels": "torch"})


def variants(strategy: str, batch: int, largest: int | None = None) -> tuple:
    """The decoder paths ``strategy`` is timed on at ``batch`` (``largest``: the stage's largest batch)."""
    extra: tuple = ()
    if strategy == "none" and batch == largest and batch > 1 and torch.cuda.is_available():
        extra += (OTHER_ATTENTION,)
    return VARIANTS + extra


def compiled_against_eager(speed: SpeedRun, strategy: str, batches) -> None:
    """``strategy`` with the decoder layers eager, compiled, and compiled with merged projections,
    passes interleaved (the order rotates each pass): per batch the median tokens/s of each, its
    same-pass ratio to the eager layers (median, spread), and whether it emitted their completions."""
    fp32 = next(speed.contenders.policy.parameters()).dtype == torch.float32  # the rehearsal: exact
    largest = max(speed.stage.size.speed_batches)
    for batch in batches:
        paths = variants(strategy, batch, largest)
        rates = {
            f"{strategy} graphs{suffix}": lambda p, f=fields, b=batch: _rate(speed, strategy, b, f)
            for _, suffix, fields in paths
        }
        runs = speed.in_passes(batch, rates, speed.stage.size.fast_path_passes)
        eager = runs[f"{strategy} graphs"]
        for name, suffix, _ in paths[1:]:
            variant = runs[f"{strategy} graphs{suffix}"]
            both = sorted(eager.keys() & variant.keys())
            if not both:
                continue
            same = eager[both[-1]]["completions"] == variant[both[-1]]["completions"]
            if fp32:
                speed.stage.check(f"{strategy} batch {batch}: {name} emits the eager layers' completions", same)
            speed.headline[speed.name(f"{strategy} {name} / eager layers, batch {batch}")] = (
                f"{same_pass_ratio(variant, eager)}, same completions: {same}"
            )
        if strategy == "none" and batch == largest > 1:  # the target: tokens/s, median of the passes
            for name, suffix, _ in paths:
                passes = [r["tok_s"] for r in runs[f"{strategy} graphs{suffix}"].values()]
                if passes:
                    speed.headline[speed.name(f"none tok/s, batch {batch}, {name} (median; passes)")] = (
                        f"{statistics.median(passes):,.0f} ({', '.join(f'{x:,.0f}' for x in passes)})"
                    )
    speed.stage.record("headline", speed.headline)


def _rate(speed: SpeedRun, strategy: str, batch: int, fields: dict) -> dict:
    return speed.contenders.engine_rate(
        strategy, speed.graphs, speed.prompts[:batch], speed.greedy, speed.warm[:batch], **fields
    )


def kernels_per_step(speed: SpeedRun, policy, copy_gbs: float) -> None:
    """One batch-1 decode graph's replay on each decoder path: kernels, device time, wall time
    against the bandwidth floor (the issue's target: at most 2.0 ms, 3x the floor); and each
    path's whole decode step as timed against the floor."""
    context = len(speed.prompts[0]) + speed.stage.size.max_new_tokens // 2
    floor, _ = decode_floor_ms(policy, context, copy_gbs)
    steps = {r["contender"]: r["decode_step_ms"] for r in speed.rows if r["batch"] == 1 and "decode_step_ms" in r}
    for name, suffix, _ in variants("none", 1):
        step = steps.get(speed.name(f"none graphs{suffix}"))
        if step is not None:
            speed.headline[speed.name(f"batch-1 decode step / floor, {name}")] = f"{step / floor:.2f}x ({step:.2f} ms)"
    profiles = {}
    for name, _, fields in VARIANTS:
        with speed.stage.part(speed.name(f"batch-1 decode replay, {name}"), 10, cuda_only=True) as ok:
            if ok:
                engine = speed.contenders.engine("none", speed.graphs, **fields)
                profile = replay_profile(engine)
                profile["replay_ms"] = replay_ms(engine)
                profiles[name] = profile
                layers = policy.config.num_hidden_layers
                speed.headline[speed.name(f"batch-1 decode replay, {name}")] = (
                    f"{profile['kernels']} kernels ({profile['kernels'] / layers:.1f} per layer), "
                    f"{profile['replay_ms']:.2f} ms = {profile['replay_ms'] / floor:.1f}x the floor ({floor:.2f} ms)"
                )
    speed.stage.record(speed.name("decode_replay_profiles"), profiles)


def hf_static_cache(speed: SpeedRun) -> None:
    """transformers' fastest own path at batch 1: ``generate`` with its static cache, which it
    compiles on a GPU (the compile, about a minute, is not timed)."""
    name = "HF generate static cache"
    with speed.stage.part(f"{name} batch 1", 60) as ok:
        if ok:
            rate = speed.contenders.hf_rate(speed.prompts[:1], speed.greedy, static=True)
            speed.add({"contender": name, "batch": 1, **rate})
    with speed.stage.part("HF generate batch 1", 5) as ok:
        if ok:
            rate = speed.contenders.hf_rate(speed.prompts[:1], speed.greedy)
            speed.add({"contender": "HF generate", "batch": 1, **rate})
    for contender in ("none graphs", *(f"none graphs{suffix}" for _, suffix, fields in variants("none", 1) if fields)):
        speed.headline[f"{contender} / {name}, batch 1"] = str(speed.ratio((contender, 1), (name, 1)))
        speed.headline[f"{contender} / HF generate, batch 1"] = str(speed.ratio((contender, 1), ("HF generate", 1)))
    speed.stage.record("headline", speed.headline)


def big_policy(speed: SpeedRun, copy_gbs: float) -> None:
    """The batch-1 figures again on a policy of Llama-3-8B's width, MLP and depth
    (``CheckSize.big_policy``), where reading the weights dominates (the issue's target: a batch-1
    step within 1.4x its floor): layers eager and compiled, the replay's kernels against the floor,
    ``chain:4`` both ways. Grown in the run's dtype (the 1.0B policy checked the growing in fp32),
    with a KV pool of what its batches need; its rows and headline keys name it."""
    stage, size = speed.stage, speed.stage.size
    hidden, intermediate, layers = size.big_policy
    with stage.part("grow the big policy", 30) as ok:
        if not ok:
            return
        deep, _ = load_shipped("deep", "policy")
        dtype = next(speed.contenders.policy.parameters()).dtype
        big = grow_policy(
            deep, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers, device=device(), dtype=dtype
        ).eval()
    params = sum(p.numel() for p in big.parameters())
    stage.record("big_policy", {"parameters": params, "hidden": hidden, "intermediate": intermediate, "layers": layers})
    context = max(len(p) for p in speed.prompts) + size.max_new_tokens + 64  # 64: draft tokens' slots
    contenders = Contenders(
        big,
        speed.contenders.drafter,
        speed.contenders.tokenizer,
        max_num_seqs=max(size.big_batches),
        kv_cache_tokens=max(size.big_batches) * context,
    )
    size_name = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"  # the rehearsal's is small
    big_run = replace(speed, contenders=contenders, label=f"{size_name} policy: ")
    try:
        compiled_against_eager(big_run, "none", size.big_batches)
        kernels_per_step(big_run, big, copy_gbs)
        compiled_against_eager(big_run, "chain:4", (1,))
    finally:
        contenders.close()
        del big, contenders, big_run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def long_contexts(speed: SpeedRun, policy, copy_gbs: float, attention: str) -> None:
    """Batch-1 decoding after a long prompt (RL reasoning rollouts run 4k-32k tokens): the decode
    step against its bandwidth floor at each context, with each attention path (gather + SDPA, and
    the split-KV Triton kernel on a GPU). Per context an engine per path, warmed on another prompt
    of the same length (its graphs captured), then timed in ``CheckSize.fast_path_passes`` passes,
    the paths interleaved."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=LONG_CONTEXT_NEW, ignore_eos=True)
    paths = ("torch", "triton") if torch.cuda.is_available() else (attention,)
    vocab = sorted(set(range(len(speed.contenders.tokenizer))) - set(speed.contenders.tokenizer.all_special_ids))
    for context in speed.stage.size.long_contexts:
        generator = torch.Generator().manual_seed(context)
        prompts = [[vocab[i] for i in torch.randint(len(vocab), (context - LONG_CONTEXT_NEW,), generator=generator)]]
        warm = [list(reversed(prompts[0]))]
        engines: dict[str, RolloutEngine] = {}
        try:
            for kernels in paths:
                with speed.stage.part(f"none kernels={kernels} context {context}: warm", 15) as ok:
                    if ok:
                        engines[kernels] = _long_context_engine(speed, policy, context, kernels)
                        engines[kernels].generate(warm, greedy)
            steps: dict[str, list[float]] = {k: [] for k in engines}
            for p in range(speed.stage.size.fast_path_passes):
                for kernels in list(engines) if p % 2 == 0 else list(reversed(engines)):
                    with speed.stage.part(f"none kernels={kernels} context {context} pass {p + 1}", 5) as ok:
                        if ok:
                            steps[kernels].append(_decode_step_ms(engines[kernels], prompts, greedy))
        finally:
            for engine in engines.values():
                engine.close()
        _record_long_context(speed, policy, copy_gbs, context, steps)
    speed.stage.record("headline", speed.headline)


def _long_context_engine(speed: SpeedRun, policy, context: int, kernels: str) -> RolloutEngine:
    config = RolloutConfig(
        graph_backend=speed.graphs,
        kernels=kernels,
        max_num_seqs=1,
        max_model_len=context,
        max_prefill_tokens=context,
        kv_cache_tokens=context + 64,
    )
    return RolloutEngine(policy, config, tokenizer=speed.contenders.tokenizer)


def _decode_step_ms(engine: RolloutEngine, prompts, greedy) -> float:
    """One timed rollout's mean decode step (the prefill not counted)."""
    before = engine.stats.as_dict()
    timed(lambda: engine.generate(prompts, greedy))
    after = engine.stats.as_dict()
    steps = max(1, after["decode_steps"] - before["decode_steps"])
    return 1000 * (after["decode_time_s"] - before["decode_time_s"]) / steps


def _record_long_context(speed: SpeedRun, policy, copy_gbs: float, context: int, steps: dict[str, list[float]]) -> None:
    floor, nbytes = decode_floor_ms(policy, context, copy_gbs)
    for kernels, runs in steps.items():
        if not runs:
            continue
        step_ms = statistics.median(runs)
        name = f"none kernels={kernels} context {context}"
        speed.headline[f"{name}: decode step / floor"] = (
            f"{step_ms / floor:.1f}x ({step_ms:.2f} ms; {min(runs):.2f}-{max(runs):.2f})"
        )
        speed.add(
            {
                "contender": name,
                "batch": 1,
                "context": context,
                "tok_s": 1000 / step_ms,
                "decode_step_ms": step_ms,
                "decode_step_ms_passes": [round(r, 3) for r in runs],
                "floor_ms": floor,
                "bytes_per_step": nbytes,
                "achieved_gbs": nbytes / (step_ms / 1000) / 1e9,
            }
        )
    if len(steps) == 2 and all(steps.values()):
        ratios = [t / s for s, t in zip(steps["torch"], steps["triton"])]
        speed.headline[f"context {context}: triton / torch decode step"] = (
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        )
