"""The rollout's work waiting to be dealt to workers (Ray-free, tested alone).

``static``: the requests are cut into one fixed shard per worker (prompt groups kept together,
the old behaviour, kept as the baseline) and a worker takes a whole shard at a time.
``divided``: one global queue; any worker with room pulls the next chunk, so a worker that runs
dry takes work that would otherwise wait behind a busy one (Seer's divided rollout). Work that
comes back (a dead worker's unfinished requests, requests moved off a busy worker) goes first,
to whichever worker pulls next, or to the worker it was moved for.

Order ``fifo`` deals requests in request order; ``predicted`` deals the longest-predicted first,
after one probe sample of every prompt whose length nobody can predict yet, so the siblings'
lengths are known early (Seer's context-aware scheduling).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..rollout.handoff import PartialRequest

SCHEDULES = ("static", "divided")
ORDERS = ("fifo", "predicted")


@dataclass
class Task:
    """One request to generate (or to continue, with ``resume``); ``attempt`` counts the workers
    it was lost with, plus one; ``for_worker``: moved for that worker, which takes it first."""

    index: int
    resume: PartialRequest | None = None
    attempt: int = 1
    for_worker: int | None = None


class WorkQueue:
    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        schedule: str,
        order: str,
        shards: Sequence[Sequence[int]] | None = None,  # static
        predict: Callable[[int], float | None] = lambda index: None,
        group_of: Callable[[int], object] | None = None,
    ) -> None:
        """``predict(index)``: the predicted completion length of request ``index`` (None: unknown),
        asked again at every pull, so predictions that improve during the rollout reorder what is
        still waiting. ``group_of(index)``: its prompt group (default: its prompt's tokens)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if schedule == "static" and shards is None:
            raise ValueError("a static schedule needs shards")
        self.schedule, self.order = schedule, order
        self.predict = predict
        self.group_of = group_of or (lambda i: tuple(prompts[i]))
        self.front: deque[Task] = deque()  # work that came back
        self.shards: deque[list[int]] = deque(list(s) for s in shards or () if s)  # static
        self.shared: list[int] = [] if schedule == "static" else list(range(len(prompts)))  # divided
        self.probed: set[object] = set()

    def __len__(self) -> int:
        return len(self.front) + len(self.shared) + sum(len(s) for s in self.shards)

    def waiting_for(self, worker: int) -> int:
        """How many tasks ``worker`` could pull now."""
        return len(self) - sum(1 for t in self.front if t.for_worker not in (None, worker))

    def push_front(self, tasks: Sequence[Task]) -> None:
        self.front.extendleft(reversed(list(tasks)))

    def pull(self, worker: int, n: int) -> list[Task]:
        """Up to ``n`` tasks for ``worker``: moved-for-it work first, then other returned work, then
        the next shard whole (static) or the global queue's next (divided), in the queue's order."""
        mine = [t for t in self.front if t.for_worker == worker]
        anyone = [t for t in self.front if t.for_worker is None]  # moved for another: it takes them
        tasks = (mine + anyone)[:n]
        for task in tasks:
            self.front.remove(task)
        if self.schedule == "static":
            if n > 0 and not tasks and self.shards:
                tasks = [Task(i) for i in self.shards.popleft()]
            return tasks
        for i in self._next(self.shared, n - len(tasks)):
            self.shared.remove(i)
            tasks.append(Task(i))
        return tasks

    def _next(self, source: list[int], n: int) -> list[int]:
        if n <= 0 or not source:
            return []
        if self.order == "fifo":
            return source[:n]
        predicted = {i: self.predict(i) for i in source}  # once per pull
        known = [p for p in predicted.values() if p is not None]
        fallback = sum(known) / len(known) if known else 0.0
        chosen: list[int] = []
        for i in source:  # one probe per group whose length is unknown, in request order
            group = self.group_of(i)
            if len(chosen) < n and group not in self.probed and predicted[i] is None:
                self.probed.add(group)
                chosen.append(i)
        taken = set(chosen)
        rest = sorted((i for i in source if i not in taken), key=lambda i: (-(predicted[i] or fallback), i))
        return chosen + rest[: n - len(chosen)]

    def release_moved_for(self, worker: int) -> None:
        """``worker`` died: work moved for it goes to anyone."""
        for task in self.front:
            if task.for_worker == worker:
                task.for_worker = None
