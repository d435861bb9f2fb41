"""Which requests of one rollout are done, which are out on which worker, and what a worker's
death puts back: only its unfinished requests, each finished request kept and counted once."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Shard:
    """Requests dispatched together; ``attempt`` counts how many workers they have been sent to."""

    indices: list[int]
    attempt: int = 1


class RequestLedger(Generic[T]):
    """The bookkeeping of one rollout's requests, free of Ray (so it is tested alone).

    ``T`` is whatever a finished request yields (a ``RequestOutput``). A request finishes exactly
    once: a second result for it is refused, a result for a request not out on that worker too.
    """

    def __init__(self, num_requests: int, shards: list[list[int]], max_attempts: int) -> None:
        if sorted(i for s in shards for i in s) != list(range(num_requests)):
            raise ValueError("shards must hold every request index exactly once")
        self.results: list[T | None] = [None] * num_requests
        self.waiting: deque[Shard] = deque(Shard(list(s)) for s in shards)
        self.out: dict[int, list[Shard]] = {}  # worker -> shards it is generating
        self.max_attempts = max_attempts
        self.finished_count = 0
        self.rerun_count = 0

    @property
    def done(self) -> bool:
        return self.finished_count == len(self.results)

    def next_shard(self, worker: int) -> Shard | None:
        """The next waiting shard, now out on ``worker`` (None when nothing waits)."""
        if not self.waiting:
            return None
        shard = self.waiting.popleft()
        self.out.setdefault(worker, []).append(shard)
        return shard

    def finished(self, worker: int, indices: list[int], results: list[T]) -> None:
        out = {i for shard in self.out.get(worker, []) for i in shard.indices}
        for i, result in zip(indices, results, strict=True):
            if i not in out:
                raise RuntimeError(f"worker {worker} returned request {i}, which it was not given")
            if self.results[i] is not None:
                raise RuntimeError(f"request {i} finished twice")
            self.results[i] = result
            self.finished_count += 1

    def shard_done(self, worker: int, shard: Shard) -> None:
        """``worker`` ended ``shard`` (its stream is over): every request of it must have finished."""
        missing = [i for i in shard.indices if self.results[i] is None]
        if missing:
            raise RuntimeError(f"worker {worker} ended a shard with requests {missing} unfinished")
        self.out[worker].remove(shard)

    def unfinished(self, shard: Shard) -> list[int]:
        return [i for i in shard.indices if self.results[i] is None]

    def worker_lost(self, worker: int) -> list[Shard]:
        """``worker`` died: its unfinished requests wait again (first in line), one shard per lost
        shard; finished ones stay. Raises ``RuntimeError`` when a request has been tried on
        ``max_attempts`` workers."""
        requeued = []
        for shard in self.out.pop(worker, []):
            left = self.unfinished(shard)
            if not left:
                continue
            if shard.attempt >= self.max_attempts:
                raise RuntimeError(f"{len(left)} requests failed on {shard.attempt} workers (max_shard_attempts)")
            requeued.append(Shard(left, shard.attempt + 1))
            self.rerun_count += len(left)
        self.waiting.extendleft(reversed(requeued))
        return requeued
