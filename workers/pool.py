"""The live rollout workers (Ray actors): spawning, replacing, death, and which policy and
drafter versions each one holds, so that a call to a worker carries exactly the weights it lacks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class WorkerPool:
    def __init__(self, spawn_actor: Callable[[int], tuple[Any, int, int | None]], event: Callable[..., None]) -> None:
        """``spawn_actor(index)`` starts an actor and returns it with the (policy, drafter) versions
        it holds once started."""
        self._spawn_actor = spawn_actor
        self._event = event
        self._next_index = 0
        self.workers: dict[int, Any] = {}
        self.held: dict[int, tuple[int, int | None]] = {}  # worker -> (policy version, drafter version)

    def spawn(self) -> int:
        index = self._next_index
        self._next_index += 1
        actor, policy_version, drafter_version = self._spawn_actor(index)
        self.workers[index] = actor
        self.held[index] = (policy_version, drafter_version)
        self._event("spawn", index)
        return index

    def fill(self, num_workers: int) -> None:
        while len(self.workers) < num_workers:
            index = self.spawn()
            logger.info("started rollout worker %d (%d wanted)", index, num_workers)

    def mark_dead(self, index: int, error: BaseException) -> None:
        logger.warning("rollout worker %d died: %s", index, error)
        self.workers.pop(index, None)
        self.held.pop(index, None)
        self._event("worker_died", index, error=type(error).__name__)

    def set_held(self, index: int, *, policy: int | None = None, drafter: int | None = None) -> None:
        old_policy, old_drafter = self.held[index]
        self.held[index] = (old_policy if policy is None else policy, old_drafter if drafter is None else drafter)

    def call_all(self, method: str, *args: Any, skip: int | None = None) -> list[int]:
        """``method(*args)`` on every live worker but ``skip``, waited for; workers that died are
        marked dead. Returns the workers that answered."""
        import ray

        pending = {getattr(actor, method).remote(*args): i for i, actor in self.workers.items() if i != skip}
        answered = []
        for ref, index in pending.items():
            try:
                ray.get(ref)
                answered.append(index)
            except ray.exceptions.RayActorError as e:
                self.mark_dead(index, e)
        return answered

    def kill_all(self) -> None:
        import ray

        for actor in self.workers.values():
            ray.kill(actor)
        self.workers.clear()
        self.held.clear()
