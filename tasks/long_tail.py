"""The long-tailed RL workload: chain sums whose completions run from a hundred tokens to two thousand.

An RL step's rollout is as long as its longest completion. Reasoning policies write most of their
completions in a few hundred tokens and a few in thousands, and those few decode alone at batch 1
while the rest of the step waits: the tail that speculation shortens. The shipped policies learned
chain sums of at most 40 terms (responses of at most about 370 tokens). At T = 1 they answer a
longer problem after about that many tokens, and past their trained positions they lose the chain
(on 150-200 terms the deep policy writes digit fragments, which its drafter LM drafts at 1.9-2.4
tokens a step against 3.8 on its own task). So this workload starts by teaching the policy longer
chains:

* :data:`LONG_TAIL_TASK`: n terms from a power law on [12, 159] (exponent 2), or with probability
  1/8 uniform on [160, 200]. Reference responses: median about 210 tokens, p75 520, p90 1,630,
  p99 1,930, max 1,970 (p99 / median about 9).
* :func:`long_tail_problems`: a GRPO run's prompts, a step's worth at a time, each step holding
  exactly one long problem, so that every step's rollout has its tail (a sampled set could give
  a step none).
* :func:`extend_policy` fine-tunes a policy on the task's solutions (half of them with n uniform
  on [12, 200]) and lets its config admit contexts of :data:`MAX_CONTEXT` tokens;
  :func:`distill_drafter` distils a drafter LM onto it, on the same stream. Both are short SFT runs
  (:func:`tasks.sft.fit_model`) on whatever device the models are on.
* :func:`length_fidelity`: whether a policy's greedy completions of long problems follow the chain
  (their lengths against the references', ended by EOS, right);
* :func:`length_summary`: what a rollout's completion lengths look like (median, p90, p99, max).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .chain_sum import ChainSumConfig, sample_problem
from .sft import SFTConfig, fit_model

LONG_TAIL_TASK = ChainSumConfig(min_terms=12, max_terms=200, tail_exponent=2.0, long_fraction=0.125, long_min_terms=160)
MAX_CONTEXT = 4096  # the extended policy's max_position_embeddings: a 200-term prompt and its response fit


@dataclass(frozen=True)
class ExtendRecipe:
    """The SFT runs that teach a policy :data:`LONG_TAIL_TASK` and distil its drafter LM onto it."""

    policy_steps: int = 400
    drafter_steps: int = 300
    batch_size: int = 16
    # 150 steps of 8 at this rate on a CPU gave coherent chains that end, about as long as n asks
    policy_lr: float = 1e-3
    drafter_lr: float = 1e-3
    max_terms: int = LONG_TAIL_TASK.max_terms  # the rehearsal trains on shorter problems
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("policy_steps", "drafter_steps", "batch_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not (
            isinstance(self.max_terms, int) and LONG_TAIL_TASK.min_terms < self.max_terms <= LONG_TAIL_TASK.max_terms
        ):
            raise ValueError(
                f"max_terms must be an int in ({LONG_TAIL_TASK.min_terms}, {LONG_TAIL_TASK.max_terms}], "
                f"got {self.max_terms!r}"
            )

    def task(self) -> ChainSumConfig:
        """The task trained on: :data:`LONG_TAIL_TASK`, cut at ``max_terms``."""
        if self.max_terms == LONG_TAIL_TASK.max_terms:
            return LONG_TAIL_TASK
        return ChainSumConfig(
            min_terms=LONG_TAIL_TASK.min_terms,
            max_terms=self.max_terms,
            tail_exponent=LONG_TAIL_TASK.tail_exponent,
            long_fraction=LONG_TAIL_TASK.long_fraction,
            long_min_terms=min(LONG_TAIL_TASK.long_min_terms, self.max_terms),
        )

    def sft(self, steps: int, lr: float) -> SFTConfig:
        task = self.task()
        # the longest example: the prompt (2 tokens a term) and the response (at most 10 a term), and slack
        longest = 12 * task.max_terms + 64
        return SFTConfig(
            steps=steps,
            batch_size=self.batch_size,
            lr=lr,
            warmup_steps=max(1, min(20, steps // 10)),
            max_len=longest,
            uniform_fraction=0.5,
            log_every=max(1, min(50, steps // 4)),
            task=task,
            seed=self.seed,
            threads=torch.get_num_threads(),  # the process's, as it is (fit_model sets it)
        )


def long_tail_problems(steps: int, per_step: int, seed: int, task: ChainSumConfig = LONG_TAIL_TASK) -> list[str]:
    """``steps * per_step`` questions, a step's ``per_step`` at a time: one from the task's long
    component (n uniform on ``[long_min_terms, max_terms]``) and the rest from its body, in a
    shuffled order within the step."""
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not (isinstance(per_step, int) and per_step >= 2):
        raise ValueError(f"per_step must be an int >= 2 (one long problem and the body), got {per_step!r}")
    if not task.long_fraction > 0:
        raise ValueError("task must have a long component (long_fraction > 0)")
    rng = random.Random(seed)
    body = ChainSumConfig(
        min_terms=task.min_terms, max_terms=task.long_min_terms - 1, tail_exponent=task.tail_exponent, long_fraction=0
    )
    questions: list[str] = []
    for _ in range(steps):
        step = [sample_problem(rng, num_terms=rng.randint(task.long_min_terms, task.max_terms))]
        step += [sample_problem(rng, body) for _ in range(per_step - 1)]
        rng.shuffle(step)
        questions += [p.question for p in step]
    return questions


def extend_policy(policy: torch.nn.Module, tokenizer: Any, recipe: ExtendRecipe, progress: bool = False) -> dict:
    """Fine-tune ``policy`` in place on the long-tailed task; its config then admits
    :data:`MAX_CONTEXT` tokens. Returns :func:`tasks.sft.fit_model`'s metrics."""
    metrics = fit_model(
        policy, recipe.sft(recipe.policy_steps, recipe.policy_lr), tokenizer, None, progress, "extend policy"
    )
    _admit_long_contexts(policy)
    return metrics


def distill_drafter(
    drafter: torch.nn.Module, policy: torch.nn.Module, tokenizer: Any, recipe: ExtendRecipe, progress: bool = False
) -> dict:
    """Distil ``drafter`` in place onto ``policy`` (KL to its next-token distributions) on the
    long-tailed task's solutions; its config then admits :data:`MAX_CONTEXT` tokens."""
    policy.eval()
    sft = recipe.sft(recipe.drafter_steps, recipe.drafter_lr)
    metrics = fit_model(drafter, sft, tokenizer, None, progress, "distil drafter", teacher=policy)
    _admit_long_contexts(drafter)
    return metrics


def _admit_long_contexts(model: torch.nn.Module) -> None:
    """The engine admits a sequence up to the config's ``max_position_embeddings``: raise it to
    :data:`MAX_CONTEXT` (RoPE positions need nothing else)."""
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, MAX_CONTEXT)


def length_fidelity(policy: torch.nn.Module, tokenizer: Any, num_terms: Sequence[int], seed: int = 0) -> dict:
    """How closely ``policy``'s greedy completions of problems of ``num_terms`` terms follow the
    chain the task calls for: per problem the completion's tokens against the reference response's
    (EOS included), whether it ended by EOS, whether its answer is right; and over all, the median
    length ratio and the shares ended and right. A policy that lost the chain runs to the token
    limit (twice the reference) or stops early."""
    from ..rollout.engine import RolloutEngine
    from ..rollout.params import RolloutConfig, SamplingParams
    from .chain_sum import extract_answer
    from .tokenizer import chat_ids

    rng = random.Random(seed)
    problems = [sample_problem(rng, num_terms=n) for n in num_terms]
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p.question}], True) for p in problems]
    references = [len(p.solution) + 1 for p in problems]  # a character a token, and EOS
    longest = max(len(p) for p in prompts) + 2 * max(references)
    config = RolloutConfig(max_model_len=longest, kv_cache_tokens=sum(len(p) for p in prompts) + 2 * sum(references))
    engine = RolloutEngine(policy, config, tokenizer=tokenizer)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2 * max(references)))
    rows = [
        {
            "terms": len(p.terms),
            "reference": ref,
            "completion": len(o.completion_ids),
            "ended": o.finish_reason == "stop",
            "right": extract_answer(tokenizer.decode(o.completion_ids, skip_special_tokens=True)) == p.answer,
        }
        for p, ref, o in zip(problems, references, outs)
    ]
    return {
        "length_ratio_median": round(statistics.median(r["completion"] / r["reference"] for r in rows), 3),
        "ended": sum(r["ended"] for r in rows) / len(rows),
        "right": sum(r["right"] for r in rows) / len(rows),
        "problems": rows,
    }


def length_summary(lengths: Sequence[int]) -> dict[str, float]:
    """Completion lengths in tokens: how many, their median, p90, p99 and max, and p99 / median
    (nearest-rank percentiles: a value that occurred)."""
    if not lengths:
        raise ValueError("lengths is empty")
    ordered = sorted(lengths)

    def rank(q: float) -> int:  # the smallest value with at least a share q of the values at or below it
        return ordered[max(0, math.ceil(round(q * len(ordered), 9)) - 1)]

    median = statistics.median(ordered)
    return {
        "completions": len(ordered),
        "median": median,
        "p90": rank(0.90),
        "p99": rank(0.99),
        "max": ordered[-1],
        "p99_over_median": round(rank(0.99) / median, 2) if median else float("inf"),
    }
