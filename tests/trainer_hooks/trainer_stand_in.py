"""What SpecRollout reads of a GRPOTrainer, for tests that call a rollout directly."""

from collections import defaultdict
from types import SimpleNamespace

from trl import GRPOConfig


def grpo_args(**kw) -> GRPOConfig:
    base = dict(output_dir="/tmp/unused", max_completion_length=32, report_to=[], use_cpu=True)
    base.update(kw)
    return GRPOConfig(**base)


def greedy_trainer(tokenizer, policy, max_completion_length: int = 24):
    """A stand-in for GRPOTrainer as SpecRollout reads it (greedy), and its metrics store."""
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer = SimpleNamespace(
        args=grpo_args(max_completion_length=max_completion_length, generation_kwargs={"do_sample": False}),
        processing_class=tokenizer,
        model=policy,
        _metrics=metrics,
    )
    return trainer, metrics
