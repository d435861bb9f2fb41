"""Registers tailspec with verl (the ``verl.plugins`` entry point loads this when verl is imported):
``actor_rollout_ref.rollout.name=tailspec`` then finds the replica and the trainer-side adapter."""

from __future__ import annotations

from ...extras import need

base = need("verl.workers.rollout.base", "verl", "the verl rollout backend")
RolloutReplicaRegistry = need("verl.workers.rollout.replica", "verl", "the verl rollout backend").RolloutReplicaRegistry
NAME = "tailspec"


def _replica() -> type:
    from .replica import TailspecReplica

    return TailspecReplica


RolloutReplicaRegistry.register(NAME, _replica)
base._ROLLOUT_REGISTRY[(NAME, "async")] = "tailspec.trainer_hooks.verl.adapter.TailspecServerAdapter"
