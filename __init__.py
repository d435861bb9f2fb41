"""tailspec: lossless, adaptive speculative rollouts for RL training of reasoning LLMs.

The public API is imported lazily so that ``import tailspec`` stays cheap (TRL is only loaded
when ``GRPOTrainer`` is used).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "RolloutEngine": "tailspec.rollout.engine",
    "RolloutConfig": "tailspec.rollout.params",
    "SamplingParams": "tailspec.rollout.params",
    "RequestOutput": "tailspec.rollout.request",
    "SpecRollout": "tailspec.trainer_hooks.spec_rollout",
    "SpecRolloutConfig": "tailspec.trainer_hooks.config",
    "OnlineTrainingConfig": "tailspec.trainer_hooks.config",
    "WorkersConfig": "tailspec.workers.config",
    "GRPOTrainer": "tailspec.trainer_hooks.grpo_trainer",
    "DrafterFromTrainer": "tailspec.trainer_hooks.drafter_from_trainer",
    "weights_location": "tailspec.packed_weights",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tailspec' has no attribute {name!r}")
    return getattr(import_module(module), name)
