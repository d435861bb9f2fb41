"""``tailspec.GRPOTrainer``: TRL's GRPOTrainer that takes ``rollout=SpecRollout(...)``."""

from __future__ import annotations

import warnings
from typing import Any

import trl

from .spec_rollout import SpecRollout


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with a tailspec rollout.

    ``rollout`` defaults to ``SpecRollout()`` (the trainer's live policy, colocated, zero-copy).
    Any callable with TRL's ``rollout_func`` signature is accepted. ``rollout_func=`` is accepted
    as a synonym, not together with ``rollout=``.
    """

    def __init__(self, *args: Any, rollout: Any | None = None, rollout_func: Any | None = None, **kwargs: Any):
        if rollout is not None and rollout_func is not None:
            raise ValueError("pass rollout= or rollout_func=, not both")
        rollout = rollout if rollout is not None else rollout_func
        if rollout is None:
            rollout = SpecRollout()
        if not callable(rollout):
            raise ValueError(f"rollout must be callable as rollout(prompts, trainer), got {type(rollout).__name__}")
        if kwargs.get("tools"):
            raise ValueError("tailspec.GRPOTrainer does not support tools yet")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*'rollout_func'.*experimental", category=UserWarning)
            super().__init__(*args, rollout_func=rollout, **kwargs)
        self.rollout = rollout
