"""Shared fixtures of the EAGLE-3 tests: tiny targets, heads, and a head trained on a target's rollouts."""

from __future__ import annotations

import functools

import torch

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, FeatureBuffer
from tailspec.drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import generate_committing_each_step, random_prompts, tiny_random_model

VOCAB = 96


@functools.cache
def target(arch: str = "llama", **kwargs):
    return tiny_random_model(arch, seed=1, **kwargs)


def random_head(model, seed: int = 0, std: float = 0.2, **cfg) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(model.config, **cfg))
    head.reset_parameters(std=std)  # peaked drafts
    return head.eval()


def collect(
    model,
    head,
    prompts,
    params,
    strategy: str = "none",
    buffer: FeatureBuffer | None = None,
    committed: bool = False,
    **cfg,
):
    """Run ``prompts`` with an EAGLE-3 drafter attached (``committed``: every step committed before
    the next is launched); returns (engine, outputs, buffer)."""
    buffer = buffer if buffer is not None else FeatureBuffer()
    drafter = Eagle3Drafter(head, model, buffer=buffer)
    engine = RolloutEngine(model, RolloutConfig(strategy=strategy, **cfg), drafter=drafter)
    run = generate_committing_each_step if committed else lambda e, p, q: e.generate(p, q)
    return engine, run(engine, prompts, params), buffer


@functools.cache
def trained_head(arch: str = "llama", steps: int = 120) -> Eagle3Head:
    """A head trained on greedy rollouts of ``target(arch)``: accepts often, not always."""
    model = target(arch)
    head = random_head(model, seed=5, std=0.02)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    _, _, buffer = collect(model, head, random_prompts(48, seed=77), params)
    trainer = DrafterTrainer(head, model.get_input_embeddings(), buffer, DrafterTrainingConfig(batch_size=8, seed=1))
    trainer.train(steps)
    return head.eval()
