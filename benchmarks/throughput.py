"""Rollout throughput: HF ``generate`` (batched, as TRL does) vs the tailspec engine.

Same model, same prompts, same sampling parameters, same batch composition, measured in one
run. Tokens/s counts completion tokens up to and including EOS, i.e. what the trainer gets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..progress import progress_bar
from ..rollout.engine import RolloutEngine
from ..rollout.params import RolloutConfig, SamplingParams
from .hf_baseline import hf_generate

logger = logging.getLogger(__name__)


@dataclass
class ThroughputResult:
    backend: str
    batch_size: int
    num_prompts: int
    completion_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def _timed(run: Callable[[list[list[int]]], list[list[int]]], batches: list[list[list[int]]]) -> tuple[int, float]:
    tokens, start = 0, time.perf_counter()
    for batch in batches:
        tokens += sum(len(c) for c in run(batch))
    return tokens, time.perf_counter() - start


def measure_throughput(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    batch_sizes: tuple[int, ...],
    prompts_per_size: dict[int, int],
    eos_token_ids: list[int],
    pad_token_id: int,
    engine_config: RolloutConfig | None = None,
    repeats: int = 1,
) -> list[ThroughputResult]:
    """Tokens/s of both backends at each batch size; best of ``repeats`` runs each."""
    engine = RolloutEngine(model, engine_config or RolloutConfig(), eos_token_ids=eos_token_ids)
    backends = {
        "hf_generate": lambda b: hf_generate(model, b, params, eos_token_ids, pad_token_id),
        "tailspec": lambda b: [o.completion_ids for o in engine.generate(b, params)],
    }
    engine.generate(prompts[:2], params.with_updates(max_new_tokens=8))  # warm-up
    hf_generate(model, prompts[:2], params.with_updates(max_new_tokens=8), eos_token_ids, pad_token_id)
    results = []
    for bs in progress_bar(batch_sizes, desc="throughput", unit="batch size"):
        n = prompts_per_size.get(bs, bs)
        chosen = [prompts[i % len(prompts)] for i in range(n)]
        batches = [chosen[i : i + bs] for i in range(0, n, bs)]
        for name, run in backends.items():
            best = None
            for _ in range(repeats):
                torch.manual_seed(0)
                tokens, secs = _timed(run, batches)
                if best is None or tokens / secs > best.tokens_per_s:
                    best = ThroughputResult(name, bs, n, tokens, secs)
            logger.info("%s bs=%d: %.0f tok/s", name, bs, best.tokens_per_s)
            results.append(best)
    return results
