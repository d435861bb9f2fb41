"""Stage ``graphs``: the pool of captured CUDA graphs.

Captured and eager decoding give the same tokens (and logprobs to rounding); replays are counted;
a small ``graph_memory_mb`` forces evictions and the pool stays under it with the output unchanged;
capture time per shape and the memory held are read on the deep policy in bf16.
"""

from __future__ import annotations

import torch

from ...rollout.engine import RolloutEngine
from ...rollout.params import RolloutConfig, SamplingParams
from ...testing import perturbed_copy, random_prompts, tiny_random_model
from .common import Stage, device, graph_backend
from .models import deep_policy, task_prompts


def run_engine(model, drafter, strategy: str, prompts, params, **config) -> tuple[RolloutEngine, list]:
    engine = RolloutEngine(model, RolloutConfig(strategy=strategy, **config), drafter=drafter)
    return engine, engine.generate(prompts, params)


def captured_equals_eager(stage: Stage) -> None:
    dev = device()
    model = tiny_random_model("llama", seed=1, initializer_range=0.2)
    drafter = perturbed_copy(model, noise=0.3, seed=7).to(dev)
    model = model.to(dev)
    prompts = random_prompts(12, seed=3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=10 + 3 * i) for i in range(len(prompts))]
    for strategy in ("none", "chain:3", "tree:3,2,6"):
        with stage.part(f"captured = eager, {strategy}", 3) as ok:
            if not ok:
                continue
            draft = None if strategy == "none" else drafter
            _, want = run_engine(model, draft, strategy, prompts, params, graph_backend="none")
            engine, got = run_engine(model, draft, strategy, prompts, params, graph_backend=graph_backend())
            same = all(a.completion_ids == b.completion_ids for a, b in zip(got, want))
            diff = max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs))
            st = engine.runner.graph_pool.stats
            stage.check(
                f"captured = eager, {strategy}",
                same and diff < 1e-3 and st.hits > 0,
                f"tokens {'equal' if same else 'DIFFER'}, max logprob diff {diff:.1e}, "
                f"{st.captures} captures, {st.hits} replays",
            )
    with stage.part("budget and eviction", 5) as ok:
        if ok:
            budget_and_eviction(stage, prompts, params)


def budget_and_eviction(stage: Stage, prompts, params) -> None:
    """A 64k vocabulary makes each graph's logits large (batch 16: 4 MiB): under a 6 MiB budget the
    shapes a draining batch visits (16, 8, 4, 2, 1) cannot all stay."""
    model = tiny_random_model("llama", seed=1, initializer_range=0.2, vocab_size=65536).to(device())
    _, want = run_engine(model, None, "none", prompts, params, graph_backend="none")
    engine, got = run_engine(model, None, "none", prompts, params, graph_backend=graph_backend(), graph_memory_mb=6)
    pool = engine.runner.graph_pool
    same = all(a.completion_ids == b.completion_ids for a, b in zip(got, want))
    held = {"budget_bytes": pool.memory_budget, "held_bytes": pool.stats.bytes, "entries": len(pool)}
    stage.record("eviction", held | {"captures": pool.stats.captures, "evictions": pool.stats.evictions})
    # eager entries hold only their inputs (kilobytes): eviction needs captured graphs' outputs
    evicts = pool.stats.evictions > 0 or not torch.cuda.is_available()
    if not torch.cuda.is_available():
        stage.skip("eviction under a 6 MiB budget", "needs CUDA (eager entries are too small to evict)")
    stage.check(
        "pool under a 6 MiB budget stays under it" + (" and evicts" if torch.cuda.is_available() else ""),
        same and evicts and pool.stats.bytes <= pool.memory_budget,
        f"{pool.stats.bytes} of {pool.memory_budget} bytes held, {pool.stats.captures} captures, "
        f"{pool.stats.evictions} evictions, tokens {'equal' if same else 'DIFFER'}",
    )


def capture_costs(stage: Stage) -> None:
    dev = device()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    policy, drafter, tokenizer = deep_policy(dtype, dev)
    prompts = task_prompts(tokenizer, 16, seed=11)
    params = SamplingParams(temperature=0.0, max_new_tokens=stage.size.max_new_tokens)
    reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
    engine = RolloutEngine(
        policy, RolloutConfig(strategy="chain:4", graph_backend=graph_backend()), tokenizer=tokenizer, drafter=drafter
    )
    engine.generate(prompts, params)
    pool = engine.runner.graph_pool
    grown = (torch.cuda.memory_reserved() - reserved) if torch.cuda.is_available() else 0
    per_shape = {f"b{k.batch} t{k.tokens} c{k.context}": round(s, 4) for k, s in sorted(pool.stats.capture_s.items())}
    stage.record(
        "deep_bf16_capture",
        {
            "capture_s_per_shape": per_shape,
            "captures": pool.stats.captures,
            "replays": pool.stats.hits,
            "held_bytes": pool.stats.bytes,
            "budget_bytes": pool.memory_budget,
            "reserved_growth_bytes": grown,
        },
    )
    stage.check(
        "deep bf16 pool within graph_memory_mb",
        pool.stats.bytes <= pool.memory_budget,
        f"{pool.stats.bytes / 2**20:.1f} of {pool.memory_budget / 2**20:.0f} MiB, {len(per_shape)} shapes",
    )


def run(stage: Stage) -> None:
    captured_equals_eager(stage)
    with stage.part("capture cost on the deep policy", 15) as ok:
        if ok:
            capture_costs(stage)
