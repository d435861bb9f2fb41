"""``tailspec.GRPOTrainer``: TRL's GRPOTrainer that takes ``rollout=SpecRollout(...)``."""

from __future__ import annotations

import warnings
from typing import Any

import trl

from .spec_rollout import SpecRollout


class RolloutWeightSync:
    """Stands where TRL keeps its vLLM generation object, so that TRL's own importance-sampling
    path runs for tailspec rollouts: TRL calls :meth:`sync_weights` once per global step before
    generating, and then corrects the loss with the ratio of its recomputed logprobs to the ones
    the rollout returned (``vllm_importance_sampling_*`` settings of ``GRPOConfig``).

    The sync is forwarded to ``rollout.sync_weights(trainer)`` when the rollout has one (Ray
    workers get the new weights); the colocated engine already runs on the live module."""

    def __init__(self, trainer: trl.GRPOTrainer) -> None:
        self.trainer = trainer
        self.synced_steps: list[int] = []

    def sync_weights(self) -> None:
        self.synced_steps.append(int(self.trainer.state.global_step))
        hook = getattr(self.trainer.rollout, "sync_weights", None)
        if hook is not None:
            hook(self.trainer)

    @property
    def num_syncs(self) -> int:
        return len(self.synced_steps)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with a tailspec rollout.

    ``rollout`` defaults to ``SpecRollout()`` (the trainer's live policy, colocated, zero-copy).
    Any callable with TRL's ``rollout_func`` signature is accepted. ``rollout_func=`` is accepted
    as a synonym, not together with ``rollout=``.

    TRL applies its importance-sampling correction only on its vLLM path; here it is on for the
    rollout's processed logprobs whenever ``GRPOConfig.vllm_importance_sampling_correction`` is
    (TRL's default), with TRL's modes and clipping; ``importance_sampling=False`` turns it off.
    Weights are synced once per global step (:class:`RolloutWeightSync`).
    """

    def __init__(
        self,
        *args: Any,
        rollout: Any | None = None,
        rollout_func: Any | None = None,
        importance_sampling: bool = True,
        **kwargs: Any,
    ):
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
        self.weight_sync = RolloutWeightSync(self)
        if self.use_vllm:
            raise ValueError("tailspec.GRPOTrainer generates with its rollout; set GRPOConfig.use_vllm=False")
        if importance_sampling and self.vllm_importance_sampling_correction:
            # TRL's switch for its correction path; generation itself still goes through rollout_func
            self.use_vllm = True
            self.vllm_generation = self.weight_sync
            self._last_loaded_step = -1
