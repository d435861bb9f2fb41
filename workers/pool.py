"""The live rollout workers (actors, :mod:`tailspec.actors`): spawning, replacing, death, and which policy and
drafter versions each one holds, so that a call to a worker carries exactly the weights it lacks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..actors import ActorDied, Actors

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """Rollout workers could not be placed on the cluster in time."""


class WorkerPool:
    def __init__(
        self,
        actors: Actors,
        create_actor: Callable[[int], Any],
        ready_actor: Callable[[int, Any], tuple[int, int | None]],
        event: Callable[..., None],
        *,
        placement_timeout_s: float | None = None,
        describe_request: Callable[[int], str] = lambda n: f"{n} workers",
    ) -> None:
        """``create_actor(index)`` starts an actor (without waiting for it); once it answers,
        ``ready_actor(index, actor)`` brings it up to date and returns the (policy, drafter)
        versions it holds. Actors that do not answer within ``placement_timeout_s`` (None: wait
        forever) are killed and :class:`PlacementError` says what was asked and what is free."""
        self.actors = actors
        self._create_actor, self._ready_actor = create_actor, ready_actor
        self._event = event
        self.placement_timeout_s = placement_timeout_s
        self._describe_request = describe_request
        self._next_index = 0
        self.workers: dict[int, Any] = {}
        self.held: dict[int, tuple[int, int | None]] = {}  # worker -> (policy version, drafter version)

    def spawn(self) -> int:
        (index,) = self._spawn_many(1)
        return index

    def fill(self, num_workers: int) -> None:
        missing = num_workers - len(self.workers)
        if missing > 0:
            for index in self._spawn_many(missing):
                logger.info("started rollout worker %d (%d wanted)", index, num_workers)

    def _spawn_many(self, count: int) -> list[int]:
        actors = {}
        for _ in range(count):
            index = self._next_index
            self._next_index += 1
            actors[index] = self._create_actor(index)
        pings = [self.actors.call(a, "ping") for a in actors.values()]
        ready, _ = self.actors.wait(pings, num_returns=len(pings), timeout=self.placement_timeout_s)
        if len(ready) < len(pings):
            for actor in actors.values():
                self.actors.kill(actor)
            raise PlacementError(
                f"{len(pings) - len(ready)} of {len(pings)} rollout workers could not be placed within "
                f"placement_timeout_s={self.placement_timeout_s}: asked for {self._describe_request(len(pings))}; "
                f"the cluster has {self.actors.resources()} (another job or coordinator may hold them)"
            )
        self.actors.get(ready)  # a constructor that raised raises here
        for index, actor in actors.items():
            policy_version, drafter_version = self._ready_actor(index, actor)
            self.workers[index] = actor
            self.held[index] = (policy_version, drafter_version)
            self._event("spawn", index)
        return list(actors)

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
        pending = [(self.actors.call(actor, method, *args), i) for i, actor in self.workers.items() if i != skip]
        answered = []
        for ref, index in pending:
            try:
                self.actors.get(ref)
                answered.append(index)
            except ActorDied as e:
                self.mark_dead(index, e)
        return answered

    def kill_all(self) -> None:
        for actor in self.workers.values():
            self.actors.kill(actor)
        self.workers.clear()
        self.held.clear()
