"""Which requests of one rollout are done and which are out on which worker, and what a worker's
death puts back: only its unfinished requests, each finished request kept and counted once. A
request moved to another worker (released by one, continued by another) is no new attempt."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class RequestLedger(Generic[T]):
    """The bookkeeping of one rollout's requests, free of Ray (so it is tested alone).

    ``T`` is whatever a finished request yields (a ``RequestOutput``). A request finishes exactly
    once: a second result for it is refused, a result for a request not out on that worker too.
    """

    def __init__(self, num_requests: int, max_attempts: int) -> None:
        self.results: list[T | None] = [None] * num_requests
        self.where: dict[int, int] = {}  # request -> worker it is out on
        self.attempts = [1] * num_requests
        self.max_attempts = max_attempts
        self.finished_count = 0
        self.rerun_count = 0
        self.moved_count = 0

    @property
    def done(self) -> bool:
        return self.finished_count == len(self.results)

    def on(self, worker: int) -> list[int]:
        """Requests out on ``worker``, unfinished."""
        return [i for i, w in self.where.items() if w == worker]

    def assign(self, worker: int, indices: Iterable[int]) -> None:
        for i in indices:
            if self.results[i] is not None or i in self.where:
                raise RuntimeError(f"request {i} is already {'finished' if self.results[i] is not None else 'out'}")
            self.where[i] = worker

    def finished(self, worker: int, indices: list[int], results: list[T]) -> None:
        for i, result in zip(indices, results, strict=True):
            if self.results[i] is not None:
                raise RuntimeError(f"request {i} finished twice")
            if self.where.get(i) != worker:
                raise RuntimeError(f"worker {worker} returned request {i}, which it was not given")
            del self.where[i]
            self.results[i] = result
            self.finished_count += 1

    def released(self, worker: int, indices: list[int]) -> None:
        """``worker`` gave ``indices`` back (to be moved): they are out nowhere until assigned again."""
        for i in indices:
            if self.where.get(i) != worker:
                raise RuntimeError(f"worker {worker} released request {i}, which it was not given")
            del self.where[i]
            self.moved_count += 1

    def worker_lost(self, worker: int) -> list[tuple[int, int]]:
        """``worker`` died: its unfinished requests, each with its next attempt number, wait again;
        finished ones stay. Raises ``RuntimeError`` when a request has been tried on
        ``max_attempts`` workers."""
        lost = sorted(self.on(worker))
        for i in lost:
            if self.attempts[i] >= self.max_attempts:
                raise RuntimeError(f"request {i} failed on {self.attempts[i]} workers (max_shard_attempts)")
        for i in lost:
            del self.where[i]
            self.attempts[i] += 1
        self.rerun_count += len(lost)
        return [(i, self.attempts[i]) for i in lost]
