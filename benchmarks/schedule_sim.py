"""A discrete-event model of one rollout over N workers, to see the schedules at cluster sizes
this machine cannot run (8, 64, 256 workers). Each worker is a continuous-batching engine with a
slot limit; a step costs what the calibrated :class:`CostModel` says (measured on this machine);
the dealing mirrors :mod:`tailspec.workers.work_queue` and the rebalancing rule of
:mod:`tailspec.workers.rollout_round`. It is validated against the measured 2-worker run.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

ARMS = ("static", "divided", "divided+order", "divided+order+rebalance")


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Linear between the points, extrapolated from the last two (constant below the first)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step, measured: a decode step by batch size at a reference context length
    plus a slope per token of mean context (attention grows with it), a prefill step by tokens."""

    decode_batch: tuple[int, ...]
    decode_s: tuple[float, ...]  # at context ``reference_context``
    prefill_fixed_s: float
    prefill_per_token_s: float
    decode_slope_s: tuple[float, ...] = ()  # seconds per token of mean context, per batch size
    reference_context: int = 0

    def decode(self, batch: int, context: float | None = None) -> float:
        base = _interp(self.decode_batch, self.decode_s, batch)
        if context is None or not self.decode_slope_s:
            return base
        return base + _interp(self.decode_batch, self.decode_slope_s, batch) * (context - self.reference_context)

    def prefill(self, tokens: int) -> float:
        return self.prefill_fixed_s + self.prefill_per_token_s * tokens


def tail_seconds(finish_times: Sequence[float]) -> float:
    """From the 90th-percentile finish to the last (the rollout's tail latency)."""
    times = sorted(finish_times)
    return times[-1] - times[int(0.9 * (len(times) - 1))]


@dataclass
class SimRequest:
    index: int
    group: int
    prompt_len: int
    length: int  # completion tokens
    generated: int = 0
    finished_at: float = 0.0


@dataclass
class SimResult:
    arm: str
    makespan: float
    finish_times: list[float]
    idle_share: list[float]  # per worker
    moved: int = 0

    @property
    def tail_s(self) -> float:
        return tail_seconds(self.finish_times)


@dataclass
class _Worker:
    index: int
    clock: float = 0.0
    waiting: deque = field(default_factory=deque)  # (request, needs re-prefill of generated tokens)
    running: list = field(default_factory=list)
    busy_s: float = 0.0

    @property
    def held(self) -> int:
        return len(self.waiting) + len(self.running)


def simulate(
    requests: Sequence[SimRequest],
    num_workers: int,
    arm: str,
    cost: CostModel,
    *,
    max_num_seqs: int,
    chunk_size: int = 4,
    predicted: dict[int, float] | None = None,
    rebalance_min_tokens: int = 32,
) -> SimResult:
    """One rollout of ``requests`` under ``arm``; ``predicted`` maps a group to its predicted length."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    reqs = [SimRequest(r.index, r.group, r.prompt_len, r.length) for r in requests]
    predicted = predicted or {}
    workers = [_Worker(i) for i in range(num_workers)]
    queue: deque[SimRequest] = deque()
    if arm == "static":
        for w, shard in zip(workers, _static_shards(reqs, num_workers)):
            w.waiting.extend((r, False) for r in shard)
    else:
        order = reqs if arm == "divided" else sorted(reqs, key=lambda r: (-predicted.get(r.group, 0.0), r.index))
        queue.extend(order)
    inflight = len(reqs) if arm == "static" else max_num_seqs
    moved: set[int] = set()
    left = len(reqs)
    heap = [(0.0, w.index) for w in workers]
    idle: set[int] = set()  # ran dry with nothing to pull: woken only by a donor worth moving from
    while left:
        clock, wi = heapq.heappop(heap)
        w = workers[wi]
        w.clock = max(w.clock, clock)
        _deal(queue, workers, inflight, chunk_size)
        if not w.held:
            idle.add(wi)  # nothing to pull (no work comes back in this model: no deaths)
            continue
        seconds, done = _step(w, cost, max_num_seqs)
        w.clock += seconds
        w.busy_s += seconds
        for r in done:
            r.finished_at = w.clock
        left -= len(done)
        if idle and arm.endswith("rebalance") and len(w.running) >= 2:
            taker = workers[min(idle)]
            taker.clock = max(taker.clock, w.clock)  # the release arrives after the donor's step
            if _rebalance(taker, w, predicted, moved, rebalance_min_tokens):
                idle.discard(taker.index)
                heapq.heappush(heap, (taker.clock, taker.index))
        heapq.heappush(heap, (w.clock, wi))
    makespan = max(r.finished_at for r in reqs)
    return SimResult(
        arm,
        makespan,
        [r.finished_at for r in reqs],
        [1.0 - min(w.busy_s, makespan) / makespan for w in workers],
        moved=len(moved),
    )


def _deal(queue: deque, workers: list[_Worker], inflight: int, chunk_size: int) -> None:
    """Chunks round-robin to the workers with room, the least loaded first (as the coordinator)."""
    dealt = True
    while dealt and queue:
        dealt = False
        for w in sorted(workers, key=lambda x: (x.held, x.index)):
            for _ in range(min(chunk_size, inflight - w.held)):
                if queue:
                    w.waiting.append((queue.popleft(), False))
                    dealt = True


def _static_shards(reqs: list[SimRequest], n: int) -> list[list[SimRequest]]:
    """As :func:`tailspec.workers.shard_requests`: groups together, largest first to the least loaded."""
    groups: dict[int, list[SimRequest]] = {}
    for r in reqs:
        groups.setdefault(r.group, []).append(r)
    shards: list[list[SimRequest]] = [[] for _ in range(n)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(shards, key=len).extend(members)
    return [sorted(s, key=lambda r: r.index) for s in shards]


def _step(w: _Worker, cost: CostModel, max_num_seqs: int) -> tuple[float, list[SimRequest]]:
    """One engine step: admit and prefill while slots last (each admitted request samples its next
    token), else decode every running request by one token."""
    if w.waiting and len(w.running) < max_num_seqs:
        tokens = 0
        admitted = []
        while w.waiting and len(w.running) + len(admitted) < max_num_seqs:
            r, resumed = w.waiting.popleft()
            tokens += r.prompt_len + (r.generated if resumed else 0)
            admitted.append(r)
        seconds = cost.prefill(tokens)
        stepped = admitted
        w.running.extend(admitted)
    else:
        context = sum(r.prompt_len + r.generated for r in w.running) / len(w.running)
        seconds = cost.decode(len(w.running), context)
        stepped = list(w.running)
    done = []
    for r in stepped:
        r.generated += 1
        if r.generated >= r.length:
            done.append(r)
    w.running = [r for r in w.running if r not in done]
    return seconds, done


def _rebalance(taker: _Worker, donor: _Worker, predicted: dict[int, float], moved: set[int], floor: int) -> bool:
    """As the coordinator: every second of the donor's requests, longest-predicted first, moves to
    the dry worker, which re-prefills prompt and generated tokens."""
    ranked = sorted(donor.running, key=lambda r: (-predicted.get(r.group, float("inf")), r.index))
    take = [r for r in ranked[1::2] if r.index not in moved and predicted.get(r.group, floor) >= floor]
    for r in take:
        donor.running.remove(r)
        moved.add(r.index)
        taker.waiting.append((r, True))
    return bool(take)


def scaled_workload(groups: Sequence[Sequence[int]], prompt_lens: Sequence[int], num_groups: int, seed: int = 0):
    """``num_groups`` prompt groups drawn (with replacement) from measured ones: each keeps its
    members' completion lengths and its prompt length."""
    rng = random.Random(seed)
    requests: list[SimRequest] = []
    for g in range(num_groups):
        source = rng.randrange(len(groups))
        for length in groups[source]:
            requests.append(SimRequest(len(requests), g, prompt_lens[source], max(1, length)))
    return requests
