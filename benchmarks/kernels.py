"""Triton kernels against their torch paths, and the engine with and without them.

Meant for a CUDA machine (``python examples/bench_kernels.py``); ``tailspec bench`` includes it
when CUDA is available. On CPU it only runs under ``--interpret`` (Triton's interpreter, tiny
shapes): a smoke check that the script works, whose timings mean nothing.

Every contender runs on the same inputs in the same process; each time is the median of
``repeats`` runs after a warm-up (which also compiles the kernels), synchronising the device
around each run. Outputs are compared too, so a fast wrong kernel cannot go unnoticed.
"""

from __future__ import annotations

import logging
import statistics
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..draft_contract import DraftTree
from ..kernels.paged_attention import PagedAttentionPlan, paged_attention_reference
from ..rollout.engine import RolloutEngine
from ..rollout.model.attention import SequenceSlice, build_metadata, paged_attention_forward
from ..rollout.model.kv_cache import KVLayout, PagedKVCache
from ..rollout.params import RolloutConfig, SamplingParams
from ..rollout.spec.verify import verify_batch

logger = logging.getLogger(__name__)


@dataclass
class KernelTiming:
    kernel: str
    shape: str
    torch_ms: float
    triton_ms: float
    max_abs_diff: float  # attention: vs the torch reference; verification: mismatching decisions
    rel_error: float = float("nan")  # attention: |out - ref| / |ref| against a float64 reference

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.triton_ms if self.triton_ms > 0 else 0.0


@dataclass
class EngineTiming:
    strategy: str
    batch_size: int
    torch_tok_s: float
    triton_tok_s: float
    same_output: bool


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def _replayed(fn: Callable[[], object], device: torch.device, calls: int = 10) -> Callable[[], object]:
    """``calls`` calls of ``fn`` captured in one CUDA graph (after a warm-up on a side stream, where
    Triton compiles): replaying it costs the device's time alone, as the engine's captured forwards
    pay it, not the host's launch of each kernel (about 0.15 ms a call, run 10)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def _random_trees(g: torch.Generator, num_seqs: int, vocab: int, width: int, depth: int) -> list[DraftTree]:
    """Sampled drafts: ``width`` branches of ``depth`` nodes each (a chain when width = 1)."""
    trees = []
    for _ in range(num_seqs):
        tokens, parents = [], []
        for _ in range(width):
            parent = -1
            for _ in range(depth):
                parents.append(parent)
                parent = len(tokens)
                tokens.append(int(torch.randint(vocab, (1,), generator=g)))
        q = torch.softmax(torch.randn(len(tokens), vocab, generator=g), dim=-1)
        q[torch.arange(len(tokens)), tokens] += 1.0  # the drafted token is the draft's favourite
        trees.append(DraftTree(tokens, parents, q / q.sum(-1, keepdim=True)))
    return trees


def measure_verify(
    device: torch.device, num_seqs: int, vocab: int, width: int, depth: int, repeats: int, seed: int = 0
) -> KernelTiming:
    g = torch.Generator().manual_seed(seed)
    trees = _random_trees(g, num_seqs, vocab, width, depth)
    rows = sum(len(t) + 1 for t in trees)
    logprobs = torch.log_softmax(torch.randn(rows, vocab, generator=g) * 2, dim=-1).to(device)
    greedy = [False] * num_seqs
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    trees = [DraftTree(t.tokens, t.parents, t.draft_probs.to(device)) for t in trees]
    results = {}

    def run(backend: str):
        results[backend] = verify_batch(trees, logprobs, greedy, uniforms, backend=backend)

    torch_ms = _median_ms(lambda: run("torch"), device, repeats)
    triton_ms = _median_ms(lambda: run("triton"), device, repeats)
    mismatches = sum(
        (a.path, a.final_token) != (b.path, b.final_token) for a, b in zip(results["torch"], results["triton"])
    )
    shape = f"{num_seqs} seqs x {'chain' if width == 1 else f'{width} branches'} of {depth}, vocab {vocab}"
    return KernelTiming("verify (sampled)", shape, torch_ms, triton_ms, float(mismatches))


def _attention_case(device, num_seqs, context, new_tokens, heads, kv_heads, head_dim, dtype, block_size, seed):
    """One layer's paged cache of ``num_seqs`` sequences of ``context`` random cached tokens on
    shuffled blocks, and ``new_tokens`` random queries, keys and values per sequence: (cache,
    slices, positions, q, k, v), the new tensors in the engine's ``[1, heads, T, head_dim]``."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-(context + new_tokens) // block_size)
    layout = KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    cache = PagedKVCache(layout, num_seqs * per_seq, block_size)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g).to(device, dtype))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g).to(device, dtype))
    order = torch.randperm(num_seqs * per_seq, generator=g).tolist()
    slices = [SequenceSlice(order[i * per_seq : (i + 1) * per_seq], context, new_tokens) for i in range(num_seqs)]
    positions = torch.arange(context, context + new_tokens).repeat(num_seqs).to(device)
    total = num_seqs * new_tokens
    q = torch.randn(1, heads, total, head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, kv_heads, total, head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, kv_heads, total, head_dim, generator=g).to(device, dtype)
    return cache, slices, positions, q, k, v


def measure_attention(
    device: torch.device,
    num_seqs: int,
    context: int,
    new_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeats: int,
    block_size: int = 16,
    seed: int = 0,
) -> KernelTiming:
    """The engine's attention call for one layer (K/V write + attention): dense gather + SDPA
    (torch) against the kernel over block tables (triton)."""
    cache, slices, positions, q, k, v = _attention_case(
        device, num_seqs, context, new_tokens, heads, kv_heads, head_dim, dtype, block_size, seed
    )
    module = types.SimpleNamespace(layer_idx=0)
    metas = {b: build_metadata(cache, slices, positions, kernels=b) for b in ("torch", "triton")}
    outs = {}

    def run(backend: str):
        outs[backend] = paged_attention_forward(module, q, k, v, None, tailspec_attn=metas[backend])[0][0]

    torch_ms = _median_ms(lambda: run("torch"), device, repeats)
    triton_ms = _median_ms(lambda: run("triton"), device, repeats)
    plan = metas["triton"].plan
    assert isinstance(plan, PagedAttentionPlan)
    want = paged_attention_reference(q[0].transpose(0, 1).double(), cache.k[0].double(), cache.v[0].double(), plan)
    got = outs["triton"].double()
    diff = float((got - want).abs().max())
    rel = float((got - want).norm() / want.norm())
    kind = "decode" if new_tokens == 1 else f"verify {new_tokens} tokens"
    shape = f"{num_seqs} seqs, context {context}, {kind}, {heads}/{kv_heads} heads x {head_dim}, {str(dtype)[6:]}"
    return KernelTiming("paged attention", shape, torch_ms, triton_ms, diff, rel)


def measure_engine(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    strategies: Sequence[str],
    eos_token_ids: list[int],
    drafter=None,
) -> list[EngineTiming]:
    """Completion tokens/s of the engine with ``kernels="torch"`` and ``kernels="triton"`` (greedy,
    so both must produce the same tokens)."""
    out = []
    for strategy in strategies:
        rates, outputs = {}, {}
        for backend in ("torch", "triton"):
            config = RolloutConfig(strategy=strategy, kernels=backend, max_num_seqs=len(prompts))
            engine = RolloutEngine(
                model, config, eos_token_ids=eos_token_ids, drafter=drafter if strategy != "none" else None
            )
            engine.generate(prompts[:2], params.with_updates(max_new_tokens=min(8, params.max_new_tokens)))  # warm-up
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            results = engine.generate(prompts, params)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            outputs[backend] = [r.completion_ids for r in results]
            rates[backend] = sum(len(c) for c in outputs[backend]) / seconds
        same = outputs["torch"] == outputs["triton"]
        out.append(EngineTiming(strategy, len(prompts), rates["torch"], rates["triton"], same))
        logger.info("engine %s: torch %.0f tok/s, triton %.0f tok/s", strategy, rates["torch"], rates["triton"])
    return out


def kernel_table(timings: Sequence[KernelTiming]) -> str:
    lines = [
        "| kernel | shape | torch ms | Triton ms | torch / Triton | check |",
        "|---|---|---:|---:|---:|---|",
    ]
    for t in timings:
        check = (
            f"{int(t.max_abs_diff)} mismatching verdicts"
            if t.kernel.startswith("verify")
            else f"max abs diff {t.max_abs_diff:.1e}"
        )
        lines.append(f"| {t.kernel} | {t.shape} | {t.torch_ms:.3f} | {t.triton_ms:.3f} | {t.speedup:.2f}x | {check} |")
    return "\n".join(lines)


def engine_table(timings: Sequence[EngineTiming]) -> str:
    lines = [
        "| strategy | prompts | kernels=torch tok/s | kernels=triton tok/s | triton / torch | same tokens |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for t in timings:
        ratio = t.triton_tok_s / t.torch_tok_s if t.torch_tok_s else 0.0
        lines.append(
            f"| `{t.strategy}` | {t.batch_size} | {t.torch_tok_s:,.0f} | {t.triton_tok_s:,.0f} | {ratio:.2f}x | "
            f"{'yes' if t.same_output else 'NO'} |"
        )
    return "\n".join(lines)


def measure_split_kv(
    device: torch.device,
    num_seqs: int,
    context: int,
    new_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeats: int,
    passes: int = 3,
    block_size: int = 16,
    seed: int = 0,
) -> dict:
    """The split-KV kernel against the engine's gather + SDPA for one layer's attention
    over ``num_seqs`` sequences of ``context`` cached tokens, in every variant (block of keys x
    split count around the automatic one), contenders interleaved over ``passes`` passes: medians
    of the passes' medians (on CUDA, of graph replays: the device's time), the relative error against
    a float64 reference, the split kernel's achieved bytes/s (each K/V element of the context read
    once), and the eager calls' time with their launches."""
    from ..kernels.paged_attention import paged_attention_split_kv, split_count

    cache, slices, positions, q, k_new, v_new = _attention_case(
        device, num_seqs, context, new_tokens, heads, kv_heads, head_dim, dtype, block_size, seed
    )
    module = types.SimpleNamespace(layer_idx=0)
    torch_meta = build_metadata(cache, slices, positions, kernels="torch")
    plan = build_metadata(cache, slices, positions, kernels="triton").plan
    paged_attention_forward(module, q, k_new, v_new, None, tailspec_attn=torch_meta)  # writes the new K/V
    q_packed = q[0].transpose(0, 1).contiguous()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    contenders: dict[str, Callable[[], object]] = {
        "gather+sdpa": lambda: paged_attention_forward(module, q, k_new, v_new, None, tailspec_attn=torch_meta)
    }
    for block_n in (32, 64, 128):
        auto = split_count(num_seqs, kv_heads, plan.block_tables.shape[1] * block_size, sms, block_n)
        for splits in sorted({max(1, auto // 2), auto, auto * 2}):
            contenders[f"split-kv n{block_n} s{splits}"] = lambda b=block_n, s=splits: paged_attention_split_kv(
                q_packed, cache.k[0], cache.v[0], plan, num_splits=s, block_n=b
            )
    # on CUDA each contender is timed replaying a graph of `calls` calls (the engine replays graphs);
    # the eager call, launches included, is kept beside it
    calls = 10 if device.type == "cuda" else 1
    timed = {n: _replayed(fn, device, calls) if device.type == "cuda" else fn for n, fn in contenders.items()}
    ms: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(passes):
        for name, fn in timed.items():
            ms[name].append(_median_ms(fn, device, repeats) / calls)
    medians = {name: statistics.median(v) for name, v in ms.items()}
    best = min((n for n in medians if n != "gather+sdpa"), key=medians.get)
    eager_ms = {n: round(_median_ms(contenders[n], device, repeats), 4) for n in ("gather+sdpa", best)}
    want = paged_attention_reference(q_packed.double(), cache.k[0].double(), cache.v[0].double(), plan)
    got = contenders[best]().double()
    bytes_read = 2 * num_seqs * (context + new_tokens) * kv_heads * head_dim * cache.k[0].element_size()
    return {
        "shape": f"{num_seqs} seqs, context {context}, {'decode' if new_tokens == 1 else f'verify {new_tokens}'}, "
        f"{heads}/{kv_heads} heads x {head_dim}, {str(dtype)[6:]}",
        "ms": {k: round(v, 4) for k, v in medians.items()},
        "spread_ms": {k: [round(min(v), 4), round(max(v), 4)] for k, v in ms.items()},
        "best": best,
        "best_vs_gather": round(medians["gather+sdpa"] / medians[best], 3),
        "best_gb_s": round(bytes_read / (medians[best] / 1e3) / 1e9, 1),
        "timing": "cuda graph replay" if device.type == "cuda" else "eager",
        "eager_ms": eager_ms,
        "rel_error": float((got - want).norm() / want.norm()),
    }


def run_kernel_bench(
    device: torch.device,
    model: torch.nn.Module | None,
    prompts: list[list[int]],
    eos_token_ids: list[int],
    drafter=None,
    quick: bool = False,
) -> tuple[list[KernelTiming], list[EngineTiming]]:
    """The kernel micro-benchmarks at rollout-like shapes (tiny shapes when ``quick``), then the
    engine end to end on ``model`` when one is given."""
    repeats = 1 if quick else 20  # quick: Triton's interpreter on CPU, where only the checks count
    vocab = 64 if quick else 151_936  # Qwen's vocabulary
    half = torch.float32 if device.type != "cuda" else torch.bfloat16
    timings = []
    for width, depth, seqs in ((1, 4, 2), (3, 2, 2)) if quick else ((1, 4, 64), (4, 4, 64), (1, 6, 256)):
        timings.append(measure_verify(device, seqs, vocab, width, depth, repeats))
    attention_shapes = (
        [(2, 40, 1, 4, 2, 16, torch.float32), (2, 40, 5, 4, 2, 16, torch.float32)]
        if quick
        else [
            (64, 1024, 1, 32, 8, 128, half),
            (64, 1024, 5, 32, 8, 128, half),
            (256, 2048, 1, 32, 8, 128, half),
            (16, 4096, 9, 32, 8, 128, half),
            (64, 1024, 5, 32, 8, 128, torch.float32),
        ]
    )
    for seqs, context, new, heads, kv_heads, head_dim, dtype in attention_shapes:
        timings.append(measure_attention(device, seqs, context, new, heads, kv_heads, head_dim, dtype, repeats))
    engine = []
    if model is not None:
        params = SamplingParams(temperature=0.0, max_new_tokens=6 if quick else 256)
        strategies = ("none", "chain:4") if drafter is not None else ("none",)
        engine = measure_engine(model, prompts, params, strategies, eos_token_ids, drafter)
    return timings, engine


def kernels_section(timings: Sequence[KernelTiming], engine: Sequence[EngineTiming], device: str) -> str:
    parts = [
        f"Device: {device}. Median of repeated runs after a warm-up that compiles the kernels; the "
        "torch column is what the engine runs without the kernels (verification: the per-sequence "
        "rule of `rollout/spec/verify.py`; attention: gather over the block tables + SDPA).",
        "",
        kernel_table(timings),
    ]
    if engine:
        parts += ["", "Engine end to end (greedy, so both runs must emit the same tokens):", "", engine_table(engine)]
    return "\n".join(parts)


NO_CUDA_SECTION = (
    "Not measured on this machine: it has no CUDA device, and timings of Triton's CPU interpreter mean "
    "nothing. The kernels are checked on CPU in the interpreter by `tests/kernels` (exact verdicts, "
    'attention within fp32 tolerance) and by the engine tests with `kernels="triton"`. On a GPU, '
    "`python examples/bench_kernels.py` (or `tailspec bench`) measures them here."
)
