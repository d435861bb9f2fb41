"""Rollouts over workers in the coordinator's tests: a tiny random policy, a fresh EAGLE-3 head, and a
long-tail batch whose long group keeps one worker busy while the other drains.

The workers are threads of the test process (``backend="threads"``): what these tests check is the
coordinator's logic, which runs the same over either actor system (``tests/test_actors.py`` holds
both to one contract); a Ray worker costs seconds of imports to start. The tests that need Ray's
processes (a killed process, placement, a submitted job) ask for ``backend="ray"``."""

import functools

import torch

from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Head
from tailspec.drafter.eagle3.train import DrafterTrainingConfig
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import tiny_random_model
from tailspec.workers import RolloutCoordinator, WorkersConfig

EOS = 1
CONFIG = RolloutConfig(strategy="chain:3", kv_cache_tokens=8192)
TRAINING = DrafterTrainingConfig(batch_size=4, max_tokens=128, seed=0)


@functools.cache
def policy():
    return tiny_random_model("qwen2", seed=1)


def fresh_head() -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(policy().config))
    head.reset_parameters(std=0.05)
    return head


def long_tail_batch():
    """Four GRPO-style groups; one is much longer, so its worker is still busy in the tail."""
    groups = [([5, 6, 7, 8], 96), ([9, 10, 11], 6), ([3, 4], 6), ([20, 21, 22, 23, 24], 6)]
    prompts, params = [], []
    for prompt, length in groups:
        for _ in range(3):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.0, max_new_tokens=length, ignore_eos=True))
    return prompts, params


def single_engine(prompts, params, model=None):
    return RolloutEngine(model or policy(), CONFIG, drafter=fresh_head()).generate(prompts, params)


def coordinator(**overrides) -> RolloutCoordinator:
    on_event = overrides.pop("on_event", None)
    config = WorkersConfig(**{"num_workers": 2, "spot_steps_per_call": 2, "backend": "threads", **overrides})
    return RolloutCoordinator(
        policy(), CONFIG, [EOS], drafter=fresh_head(), config=config, training=TRAINING, on_event=on_event
    )


def kinds(events, kind):
    return [e for e in events if e.kind == kind]
