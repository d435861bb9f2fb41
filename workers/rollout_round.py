"""One rollout over the worker pool: dispatch shards, collect the outputs each worker streams as
its requests finish, re-run only what a dead worker had not finished, and let spot training use
the workers the tail leaves idle."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..rollout.params import SamplingParams
from ..rollout.request import RequestOutput
from .ledger import RequestLedger, Shard
from .pool import WorkerPool
from .spot import SpotTraining
from .worker import STAT_KEYS, FinishedRequests, ShardEnd

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Versions:
    """What every shard of this rollout is generated with; a worker holding another version gets
    the state (an object-store reference) with its shard."""

    policy: int
    policy_ref: Any
    drafter: int | None
    drafter_ref: Any


@dataclass
class RoundResult:
    outputs: list[RequestOutput]
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0.0))
    strategy_steps: dict[str, int] = field(default_factory=dict)
    died: int = 0
    rerun: int = 0  # requests generated again because their worker died before finishing them


class RolloutRound:
    def __init__(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        shards: list[list[int]],
        *,
        pool: WorkerPool,
        spot: SpotTraining,
        versions: Versions,
        max_attempts: int,
        respawn: bool,
        event: Callable[..., None],
    ) -> None:
        self.prompts, self.params = prompts, params
        self.ledger: RequestLedger[RequestOutput] = RequestLedger(len(prompts), shards, max_attempts)
        self.pool, self.spot, self.versions = pool, spot, versions
        self.respawn = respawn
        self._event = event
        self.streams: dict[Any, tuple[int, Shard]] = {}  # stream -> (worker, shard)
        self.idle = set(pool.workers) - {spot.training_worker}
        self.result = RoundResult(outputs=[])

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> RoundResult:
        import ray

        self.spot.start_rollout()
        while self.streams or self.ledger.waiting:
            self._dispatch()
            self._schedule_training()
            chunk = self.spot.running
            refs = list(self.streams) + ([chunk.ref] if chunk is not None else [])
            if not refs:
                raise RuntimeError("requests wait but no rollout worker is alive")
            (ready,), _ = ray.wait(refs, num_returns=1)
            if chunk is not None and ready is chunk.ref:
                self._chunk_returned()
            else:
                self._stream_ready(ready)
        self._event("rollout_end")
        if self.spot.running is not None:  # it yields before its next step; collected whenever it returns
            self.spot.stop(self.pool.workers[self.spot.running.worker], rollout_over=True)
        self.result.outputs = list(self.ledger.results)  # type: ignore[arg-type]
        self.result.rerun = self.ledger.rerun_count
        return self.result

    def _dispatch(self) -> None:
        while self.ledger.waiting and self.idle:
            index = min(self.idle)
            self.idle.discard(index)
            shard = self.ledger.next_shard(index)
            self.streams[self._generate_on(index, shard)] = (index, shard)
            self._event("shard", index, requests=len(shard.indices), attempt=shard.attempt)

    def _generate_on(self, index: int, shard: Shard) -> Any:
        v = self.versions
        held_policy, held_drafter = self.pool.held[index]
        policy_ref = v.policy_ref if held_policy != v.policy and v.policy_ref is not None else None
        drafter_ref = v.drafter_ref if held_drafter != v.drafter and v.drafter_ref is not None else None
        stream = (
            self.pool.workers[index]
            .generate_stream.options(num_returns="streaming")
            .remote(
                shard.indices,
                [self.prompts[i] for i in shard.indices],
                [self.params[i] for i in shard.indices],
                policy_ref,
                v.policy if policy_ref is not None else None,
                drafter_ref,
            )
        )
        self.pool.set_held(
            index,
            policy=v.policy if policy_ref is not None else None,
            drafter=v.drafter if drafter_ref is not None else None,
        )
        return stream

    # -- spot training -------------------------------------------------------------------------
    def _schedule_training(self) -> None:
        spot = self.spot
        waiting = bool(self.ledger.waiting)
        if self.idle and spot.should_start(others_generating=bool(self.streams), work_waiting=waiting):
            index = spot.pick_worker(self.idle)
            self.idle.discard(index)
            spot.start(index, self.pool.workers[index], busy=sorted(w for w, _ in self.streams.values()))
        if spot.running is not None and waiting:  # work arrived for it
            spot.stop(self.pool.workers[spot.running.worker], rollout_over=False)

    def _chunk_returned(self) -> None:
        index = self.spot.running.worker
        if collect_chunk(self.spot, self.pool) != "lost":
            self.idle.add(index)
        else:
            self.result.died += 1
            self._replace_if_none_left()

    # -- streams -------------------------------------------------------------------------------
    def _stream_ready(self, stream: Any) -> None:
        import ray

        index, shard = self.streams[stream]
        try:
            item = ray.get(next(stream))
        except StopIteration:  # ended without its ShardEnd (it cannot, but never spin on it)
            del self.streams[stream]
            raise RuntimeError(f"worker {index} ended a shard's stream early") from None
        except ray.exceptions.RayActorError as e:
            del self.streams[stream]
            self._worker_died(index, e)
            return
        if isinstance(item, FinishedRequests):
            self.ledger.finished(index, item.indices, item.outputs)
            self._event("finished", index, requests=len(item.indices), left=len(self.ledger.unfinished(shard)))
            return
        assert isinstance(item, ShardEnd)
        del self.streams[stream]
        self.ledger.shard_done(index, shard)
        self._add_counts(item)
        self.idle.add(index)
        self._event(
            "shard_done",
            index,
            requests=item.requests,
            samples=len(item.samples),
            drafter_version=item.drafter_version,
        )

    def _add_counts(self, end: ShardEnd) -> None:
        for k in STAT_KEYS:
            self.result.stats[k] += end.stats[k]
        for k, v in end.strategy_steps.items():
            self.result.strategy_steps[k] = self.result.strategy_steps.get(k, 0) + v
        if end.samples:
            self.spot.buffer.add(end.samples)

    # -- faults --------------------------------------------------------------------------------
    def _worker_died(self, index: int, error: BaseException) -> None:
        self.pool.mark_dead(index, error)
        self.spot.forget_worker(index)
        self.result.died += 1
        for shard in self.ledger.worker_lost(index):
            self._event("rerun", index, requests=len(shard.indices), attempt=shard.attempt)
            logger.warning("re-running %d unfinished requests of dead worker %d", len(shard.indices), index)
        self._replace_if_none_left()

    def _replace_if_none_left(self) -> None:
        if self.pool.workers or not self.ledger.waiting:
            return
        if not self.respawn:
            raise RuntimeError("every rollout worker died (respawn_dead_workers is off)")
        self.idle.add(self.pool.spawn())


def collect_chunk(spot: SpotTraining, pool: WorkerPool) -> str:
    """Take the running chunk's result (waiting for it if it is still running): ``done`` (the
    newest state), ``lost`` (its worker died) or ``failed`` (it raised)."""
    import ray

    chunk = spot.running
    try:
        result = ray.get(chunk.ref)
    except ray.exceptions.RayActorError as e:
        pool.mark_dead(chunk.worker, e)
        spot.lost()
        return "lost"
    except ray.exceptions.RayTaskError as e:
        spot.failed(e)
        return "failed"
    spot.finished(result)
    return "done"
