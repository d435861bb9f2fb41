"""``tailspec bench``: run the benchmarks on the shipped tiny-task policy and write the report."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..rollout.params import RolloutConfig, SamplingParams
from ..tasks.chain_sum import ChainSumConfig, sample_problems
from ..tasks.sft import load_tiny
from ..trainer_hooks.spec_rollout import SpecRollout
from .report import plot_throughput, throughput_table, write_report
from .throughput import measure_throughput

logger = logging.getLogger(__name__)


def task_prompts(tokenizer, num: int, seed: int) -> list[list[int]]:
    problems = sample_problems(num, seed=seed, cfg=ChainSumConfig())
    conversations = [[{"role": "user", "content": p.question}] for p in problems]
    return SpecRollout.tokenize_prompts(conversations, tokenizer)


def run_bench(out: Path, quick: bool = False, seed: int = 1234) -> str:
    torch.manual_seed(seed)
    model, tokenizer = load_tiny("policy")
    params = SamplingParams(temperature=1.0, max_new_tokens=384)
    batch_sizes = (1, 8, 32)
    per_size = {1: 4, 8: 16, 32: 32} if quick else {1: 16, 8: 32, 32: 64}
    prompts = task_prompts(tokenizer, max(per_size.values()), seed)
    results = measure_throughput(
        model,
        prompts,
        params,
        batch_sizes,
        per_size,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        engine_config=RolloutConfig(),
        repeats=1 if quick else 2,
    )
    table = throughput_table(results)
    docs = out.parent
    plot_throughput(results, docs / "bench_throughput.png")
    section = (
        "HF `generate` is called on left-padded batches exactly as `trl.GRPOTrainer` does without "
        "vLLM; tailspec runs the same batches through its engine (no speculation). "
        "Best of the repeats for each backend.\n\n"
        f"{table}\n\n![throughput](bench_throughput.png)"
    )
    workload = (
        f"the shipped tiny chain-sum policy (Qwen2 architecture, fp32), chain-sum prompts with "
        f"heavy-tailed answer lengths, T = 1.0, max_new_tokens = {params.max_new_tokens}, "
        f"seed {seed}{' (quick mode)' if quick else ''}."
    )
    write_report(
        out,
        [("Rollout throughput: tailspec engine vs HF generate", section)],
        command="tailspec bench" + (" --quick" if quick else ""),
        workload=workload,
    )
    return table
