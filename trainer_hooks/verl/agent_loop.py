"""tailspec's per-rollout numbers in verl's logged metrics: verl's agent loop manager with the
speculation summary of each batch added to its timing dict, which verl's trainer logs whole (as
``timing_s/tailspec/...``). Chosen by configuration, no code:
``actor_rollout_ref.rollout.agent.agent_loop_manager_class=tailspec.trainer_hooks.verl.agent_loop.TailspecAgentLoopManager``.
Per request the same fields are in the batch's ``non_tensor_batch``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...extras import need

_agent_loop = need("verl.experimental.agent_loop.agent_loop", "verl", "the verl rollout backend")


def rollout_metrics(fields: dict[str, Any]) -> dict[str, float]:
    """A batch's speculation summary from its per-request fields (``non_tensor_batch``): mean and
    minimum accept length, the drafter's newest version, its worst health since a push scored it
    (-1: not scored yet), the weight pushes its servers took."""
    if "accept_length" not in fields:
        return {}
    accept = np.asarray(fields["accept_length"], dtype=float)
    health = np.asarray(fields.get("drafter_health", [-1.0]), dtype=float)
    scored = health[health >= 0]
    return {
        "tailspec/accept_length/mean": float(accept.mean()),
        "tailspec/accept_length/min": float(accept.min()),
        "tailspec/drafter_version": float(np.max(fields.get("drafter_version", [0]))),
        "tailspec/drafter_health/min": float(scored.min()) if scored.size else -1.0,
        "tailspec/weight_pushes": float(np.max(fields.get("weight_pushes", [0]))),
    }


class TailspecAgentLoopManager(_agent_loop.AgentLoopManager):
    """verl's ``AgentLoopManager`` whose timing dict also holds :func:`rollout_metrics`."""

    def _performance_metrics(self, metrics: list, output: Any) -> dict[str, float]:
        timing = super()._performance_metrics(metrics, output)
        timing.update(rollout_metrics(output.non_tensor_batch))
        return timing
