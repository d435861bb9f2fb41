"""Mirror-SD across workers: a worker the long tail leaves idle drafts for one that still decodes.

A worker whose engine runs mirror steps drafts its next round's branches beside its verification
forward (``rollout/mirror/pipeline.py``); where that worker has no spare compute of its own (a GPU busy
with the target), the branches can be drafted by a worker that has finished its rollout work.
:class:`DraftHostPairs` makes those pairs during a rollout: each idle worker (while no work
waits) hosts the busiest unpaired worker's drafts; a pair ends when the busy worker's session
ends, when work arrives for the host, or when the rollout ends. Only tokens and small draft trees
cross (``PeerExecutor`` -> ``RolloutWorker.host_drafts``), never KV; a failed host only sends
its busy worker back to its own executor. Pairing takes the idle worker before spot training does.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..actors import ActorDied, Actors, WaitTimeout
from ..draft_contract import Drafter
from ..rollout.mirror.hosted import ActorExecutor

logger = logging.getLogger(__name__)

_pairing_ids = itertools.count(1)  # rising across rollouts: a host starts a fresh drafter for each new one


class DraftHostPairs:
    def __init__(self, actors: Actors, workers: dict[int, Any], event: Callable[..., None]) -> None:
        self.actors = actors
        self.workers = workers  # live actors by index (the pool's dict: dead ones leave it)
        self._event = event
        self.host_of: dict[int, int] = {}  # busy worker -> the worker drafting for it
        self.unable: set[int] = set()  # workers whose engines have no mirror steps to hand over

    @property
    def hosts(self) -> set[int]:
        return set(self.host_of.values())

    def pair(self, idle: set[int], busy: Iterable[int], load: Callable[[int], int]) -> set[int]:
        """Pair idle workers with the busiest unpaired ``busy`` ones; returns the idle workers taken."""
        taken: set[int] = set()
        waiting = sorted((w for w in busy if w not in self.host_of and w not in self.unable), key=lambda w: -load(w))
        for worker in waiting:
            free = sorted(idle - taken)
            if not free:
                break
            host, pairing = free[0], next(_pairing_ids)
            try:
                asked = self.actors.call(self.workers[worker], "use_draft_host", self.workers[host], pairing)
                ok = self.actors.get(asked)
            except ActorDied:
                continue  # the stream will report the dead worker
            if not ok:
                self.unable.add(worker)
                continue
            self.host_of[worker] = host
            taken.add(host)
            self._event("draft_host", host, for_worker=worker, pairing=pairing)
        return taken

    def unpair(self, worker: int) -> int | None:
        """End ``worker``'s pair (it is done, or gone); returns its host, now free, if it had one.
        A live busy worker goes back to its own executor; a dead one is only forgotten."""
        host = self.host_of.pop(worker, None)
        if host is None:
            return None
        actor = self.workers.get(worker)
        if actor is not None:
            try:  # waited for, so that a later pairing of this worker cannot overtake it
                self.actors.get(self.actors.call(actor, "use_draft_host", None), timeout=30)
            except (ActorDied, WaitTimeout):
                logger.debug("worker %d did not take back its own executor (gone?)", worker)
        self._event("draft_host_end", host, for_worker=worker)
        return host

    def host_gone(self, host: int) -> None:
        """A host died: its busy worker's executor has fallen back already (a failed peer does)."""
        for worker in [w for w, h in self.host_of.items() if h == host]:
            self.unpair(worker)

    def unpair_all(self) -> set[int]:
        """End every pair; returns the freed hosts."""
        return {h for h in (self.unpair(w) for w in list(self.host_of)) if h is not None}


class PeerExecutor(ActorExecutor):
    """Drafts on a draft host inside another rollout worker (``RolloutWorker.host_drafts``), one
    that has finished its rollout work while this one still decodes: its spare CPU or GPU drafts
    this worker's branches. ``pairing`` names the pairing (the host starts a fresh drafter for a
    new one); commands are numbered, since the host is a threaded actor. Closing leaves the
    worker running; only the host's drafter state is dropped (at the next pairing)."""

    name = "peer"
    failure = "the peer draft host failed"

    def __init__(self, actors: Actors, actor: Any, pairing: int, source: Drafter | None = None) -> None:
        super().__init__(actors, source)
        self._actor = actor
        self.pairing = pairing
        self._numbers = itertools.count()

    def _send(self, command: str, args: tuple) -> Any:
        return self._actors.call(self._actor, "host_drafts", self.pairing, next(self._numbers), command, args)
