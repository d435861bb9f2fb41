"""One rollout over the worker pool: deal requests to workers as they have room (or in fixed shards),
collect the outputs each worker streams as its requests finish, move requests from a busy worker to
one that ran dry, re-run only what a dead worker had not finished, and let spot training use the
workers the tail leaves idle."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..actors import ActorDied, CallFailed
from ..rollout.handoff import InboxItem
from ..rollout.params import SamplingParams
from ..rollout.request import RequestOutput
from ..rollout.stats import EngineCounts
from .config import WorkersConfig
from .draft_hosts import DraftHostPairs
from .ledger import RequestLedger
from .length_predictor import LengthPredictor
from .pool import WorkerPool
from .sharding import shard_requests
from .spot import SpotTraining
from .work_queue import Task, WorkQueue
from .worker import FinishedRequests, ReleasedRequests, ShardEnd

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Versions:
    """What every shard of this rollout is generated with; a worker holding another version gets
    the state (an object-store reference) with its shard."""

    policy: int
    policy_ref: Any
    drafter: int | None
    drafter_ref: Any


@dataclass(frozen=True)
class SchedulePlan:
    """How a rollout's requests are dealt (see :mod:`tailspec.workers.work_queue`): the schedule
    fields of :class:`WorkersConfig`, with the in-flight limit resolved against the engines."""

    schedule: str
    order: str
    chunk_size: int  # requests per pull: the granularity with which work is dealt
    inflight_per_worker: int  # requests a worker holds at once (divided); more wait in the queue
    rebalance: bool  # move requests from a busy worker to one that ran dry
    rebalance_min_tokens: int  # move only requests predicted at least this long (None: unknown, moved)

    @classmethod
    def of(cls, config: WorkersConfig, max_num_seqs: int) -> SchedulePlan:
        """``config``'s plan; a worker holds its engine's ``max_num_seqs`` unless the config caps it."""
        return cls(
            schedule=config.schedule,
            order=config.order,
            chunk_size=config.chunk_size,
            inflight_per_worker=config.inflight_per_worker or max_num_seqs,
            rebalance=config.rebalance,
            rebalance_min_tokens=config.rebalance_min_tokens,
        )


@dataclass
class RoundResult:
    outputs: list[RequestOutput]
    counts: EngineCounts = field(default_factory=EngineCounts)  # summed over the workers' sessions
    died: int = 0
    rerun: int = 0  # requests generated again because their worker died before finishing them
    moved: int = 0  # requests continued on another worker (tail rebalancing)
    idle_worker_s: float = 0.0  # worker-seconds without requests while another worker generated
    spot_busy_s: float = 0.0  # of those, the seconds a spot training chunk ran


@dataclass
class Session:
    """A worker's open serving call: ``submitted`` items so far; once ``closing`` it takes no more."""

    worker: int
    stream: Any
    submitted: int = 0
    closing: bool = False


class RolloutRound:
    def __init__(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        pool: WorkerPool,
        spot: SpotTraining,
        versions: Versions,
        plan: SchedulePlan,
        predictor: LengthPredictor,
        max_attempts: int,
        respawn: bool,
        event: Callable[..., None],
        draft_hosts: bool = False,
        train_in_gap: bool = False,
    ) -> None:
        self.prompts, self.params = prompts, params
        self.ledger: RequestLedger[RequestOutput] = RequestLedger(len(prompts), max_attempts)
        self.pool, self.spot, self.versions = pool, spot, versions
        self.plan, self.predictor = plan, predictor
        self.respawn = respawn
        self.train_in_gap = train_in_gap
        self._event = event
        shards = shard_requests(prompts, len(pool.workers)) if plan.schedule == "static" else None
        self.queue = WorkQueue(
            prompts,
            schedule=plan.schedule,
            order=plan.order,
            shards=shards,
            predict=lambda i: predictor.predict(prompts[i]),
        )
        self.inflight = len(prompts) if plan.schedule == "static" else plan.inflight_per_worker
        self.sessions: dict[int, Session] = {}  # worker -> its open session
        self.moving: dict[int, int] = {}  # request -> worker it is being moved to (release asked)
        self.moved: set[int] = set()  # requests moved once this rollout (never twice)
        self.predicted: dict[int, float | None] = {}  # at dispatch
        self.dealt: dict[int, int] = {}  # request -> order in which it was first dealt
        self.idle = set(pool.workers) - {spot.training_worker}
        self.result = RoundResult(outputs=[])
        self.pairs = DraftHostPairs(pool.actors, pool.workers, event) if draft_hosts else None

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> RoundResult:
        self.spot.start_rollout()
        while not self.ledger.done or self.sessions:
            self._deal()
            self._close_dry_sessions()
            self._pair_draft_hosts()
            self._schedule_training()
            chunk = self.spot.running
            by_ref = {s.stream: s for s in self.sessions.values()}
            refs = list(by_ref) + ([chunk.ref] if chunk is not None else [])
            if not refs:
                raise RuntimeError("requests wait but no rollout worker is alive")
            waited = time.perf_counter()
            (ready,), _ = self.pool.actors.wait(refs, num_returns=1)
            self._clock_idle(time.perf_counter() - waited, training=chunk is not None)
            if chunk is not None and ready is chunk.ref:
                self._chunk_returned()
            else:
                self._stream_ready(by_ref[ready])
        self._event("rollout_end")
        if self.pairs is not None:
            self.idle |= self.pairs.unpair_all()
        self._train_through_gap()
        self.result.outputs = list(self.ledger.results)  # type: ignore[arg-type]
        self.result.rerun = self.ledger.rerun_count
        self.result.moved = self.ledger.moved_count
        return self.result

    def _clock_idle(self, seconds: float, training: bool) -> None:
        """Charge a wait (nothing changes state during one) to the workers that held no request
        while some other worker generated, and to spot training if a chunk ran in it."""
        holding = sum(1 for w in self.pool.workers if self.ledger.on(w))
        if holding:
            self.result.idle_worker_s += seconds * (len(self.pool.workers) - holding)
            self.result.spot_busy_s += seconds if training else 0.0

    # -- dealing -------------------------------------------------------------------------------
    def _room(self, worker: int) -> int:
        session = self.sessions.get(worker)
        if session is not None and session.closing:
            return 0
        if session is None and worker not in self.idle:
            return 0  # training (or dead)
        pending = sum(1 for w in self.moving.values() if w == worker)
        return max(0, self.inflight - len(self.ledger.on(worker)) - pending)

    def _deal(self) -> None:
        """Chunks round-robin to the workers with room, the least loaded first, so the first
        (longest-predicted) chunks spread over the workers."""
        dealt = True
        while dealt and len(self.queue):
            dealt = False
            for worker in sorted(self.pool.workers, key=lambda w: (len(self.ledger.on(w)), w)):
                room = self._room(worker)
                tasks = self.queue.pull(worker, min(room, self.plan.chunk_size)) if room else []
                if tasks:
                    self._give(worker, tasks)
                    dealt = True

    def _give(self, worker: int, tasks: list[Task]) -> None:
        indices = [t.index for t in tasks]
        self.ledger.assign(worker, indices)
        for i in indices:
            self.predicted.setdefault(i, self.predictor.predict(self.prompts[i]))
            self.dealt.setdefault(i, len(self.dealt))
        items = [
            InboxItem(t.index, self.prompts[t.index], self.params[t.index], t.resume, self.predicted[t.index])
            for t in tasks
        ]
        session = self.sessions.get(worker)
        kind = "submit"
        if session is None:
            self.idle.discard(worker)
            session = self.sessions[worker] = Session(worker, self._open_session(worker, items))
            session.closing = self.plan.schedule == "static"  # a whole shard, closed at once
            kind = "shard"
        else:
            self.pool.actors.call(self.pool.workers[worker], "submit", items)
        session.submitted += len(items)
        self._event(
            kind,
            worker,
            requests=len(items),
            attempt=max(t.attempt for t in tasks),
            moved=sum(t.resume is not None for t in tasks),
            held=len(self.ledger.on(worker)),
        )

    def _open_session(self, worker: int, items: list[InboxItem]) -> Any:
        v = self.versions
        held_policy, held_drafter = self.pool.held[worker]
        policy_ref = v.policy_ref if held_policy != v.policy and v.policy_ref is not None else None
        drafter_ref = v.drafter_ref if held_drafter != v.drafter and v.drafter_ref is not None else None
        total = len(items) if self.plan.schedule == "static" else None  # static: all of it at once
        stream = self.pool.actors.stream(
            self.pool.workers[worker],
            "serve_stream",
            items,
            total,
            policy_ref,
            v.policy if policy_ref is not None else None,
            drafter_ref,
            self._session_batch(items),
        )
        self.pool.set_held(
            worker,
            policy=v.policy if policy_ref is not None else None,
            drafter=v.drafter if drafter_ref is not None else None,
        )
        return stream

    def _session_batch(self, items: list[InboxItem]) -> int:
        """The most requests a session opened with ``items`` will hold at once: a static shard's
        are all there; a divided session grows by chunks up to the in-flight limit or about the
        worker's share of the rollout (what ``adaptive`` calibrates the worker's steps for)."""
        if self.plan.schedule == "static":
            return len(items)
        share = -(-len(self.prompts) // max(1, len(self.pool.workers)))
        return max(len(items), min(self.inflight, share))

    def _close_dry_sessions(self) -> None:
        """A session holding nothing, with nothing to pull, takes work moved off a busy worker if
        that pays, or is closed (its worker may then train the drafter)."""
        for worker, session in self.sessions.items():
            if session.closing or self.ledger.on(worker) or worker in self.moving.values():
                continue
            if self.queue.waiting_for(worker):
                continue
            if self.plan.rebalance and self._ask_move(worker):
                continue
            session.closing = True
            self.pool.actors.call(self.pool.workers[worker], "close_session", session.submitted)

    def _ask_move(self, recipient: int) -> bool:
        """Ask the busiest worker holding two or more requests to give every second of its movable
        ones, ranked longest-predicted first (unknown first, then the earliest dealt), to
        ``recipient``: both then hold a like share of the long work."""
        held = {w: self.ledger.on(w) for w, s in self.sessions.items() if w != recipient and not s.closing}
        donors = [w for w, on in held.items() if len(on) >= 2]
        if not donors:
            return False
        donor = max(donors, key=lambda w: (len(held[w]), -w))
        floor = self.plan.rebalance_min_tokens
        ranked = sorted(held[donor], key=lambda i: (-(self.predicted.get(i) or float("inf")), self.dealt[i]))
        take = [
            i
            for i in ranked[1::2]
            if i not in self.moving and i not in self.moved and (self.predicted.get(i) or floor) >= floor
        ]
        if not take:
            return False
        for i in take:
            self.moving[i] = recipient
        self.pool.actors.call(self.pool.workers[donor], "release", take)
        self._event("move_asked", donor, to=recipient, requests=len(take))
        return True

    # -- draft hosts ---------------------------------------------------------------------------
    def _pair_draft_hosts(self) -> None:
        """Idle workers draft for busy ones while no work waits (``workers/draft_hosts.py``); when
        work arrives, every host is freed to take it."""
        if self.pairs is None:
            return
        if len(self.queue):
            self.idle |= self.pairs.unpair_all()
            return
        busy = [w for w in self.sessions if self.ledger.on(w)]
        self.idle -= self.pairs.pair(self.idle, busy, lambda w: len(self.ledger.on(w)))

    # -- spot training -------------------------------------------------------------------------
    def _schedule_training(self) -> None:
        spot = self.spot
        waiting = len(self.queue) > 0
        generating = [w for w in self.sessions if self.ledger.on(w)]
        free = self.idle - set(self.moving.values())  # not a worker that moved work is on its way to
        if free and spot.should_start(others_generating=bool(generating), work_waiting=waiting):
            index = spot.pick_worker(free)
            self.idle.discard(index)
            spot.start(index, self.pool.workers[index], busy=sorted(generating))
        if spot.running is not None and waiting and self.queue.waiting_for(spot.running.worker):
            spot.stop(self.pool.workers[spot.running.worker], rollout_over=False)  # work arrived for it

    def _train_through_gap(self) -> None:
        """The rollout is over. With ``train_in_gap`` a running chunk goes on, or one starts, while
        the trainer updates the policy, on the rest of the rollout's step budget (the next
        rollout stops it: ``RolloutCoordinator.settle``); otherwise a running chunk is told to stop
        (it yields before its next step and is collected whenever it returns)."""
        spot, running = self.spot, self.spot.running
        if not self.train_in_gap:
            if running is not None:
                spot.stop(self.pool.workers[running.worker], rollout_over=True)
            return
        if running is None and self.pool.workers and spot.can_train():
            index = spot.pick_worker(set(self.pool.workers))
            spot.start(index, self.pool.workers[index], busy=[], steps=spot.steps_left())

    def _chunk_returned(self) -> None:
        index = self.spot.running.worker
        if collect_chunk(self.spot, self.pool) != "lost":
            self.idle.add(index)
            # back from training while others generate: a rollout that started without this worker
            # dealt it nothing, so it takes moved work (as a worker that ran dry does) before training
            if self.plan.rebalance and not len(self.queue) and index not in self.sessions:
                self._ask_move(index)
        else:
            self.result.died += 1
            self._worker_gone(index)

    # -- streams -------------------------------------------------------------------------------
    def _stream_ready(self, session: Session) -> None:
        worker = session.worker
        try:
            item = self.pool.actors.get(next(session.stream))
        except StopIteration:  # ended without its ShardEnd (it cannot, but never spin on it)
            del self.sessions[worker]
            raise RuntimeError(f"worker {worker} ended a session's stream early") from None
        except ActorDied as e:
            self._worker_died(worker, e)
            return
        if isinstance(item, FinishedRequests):
            self._finished(worker, item)
        elif isinstance(item, ReleasedRequests):
            self._released(worker, item)
        else:
            assert isinstance(item, ShardEnd)
            del self.sessions[worker]
            self._add_counts(item)
            self.idle.add(worker)
            if self.pairs is not None and (host := self.pairs.unpair(worker)) is not None:
                self.idle.add(host)
            self._event(
                "shard_done",
                worker,
                requests=item.requests,
                samples=len(item.samples),
                drafter_version=item.drafter_version,
            )

    def _finished(self, worker: int, item: FinishedRequests) -> None:
        self.ledger.finished(worker, item.indices, item.outputs)
        for i, output in zip(item.indices, item.outputs):
            self.moving.pop(i, None)
            self.predictor.observe(self.prompts[i], len(output.completion_ids), self.predicted.get(i))
        held = len(self.ledger.on(worker))
        self._event("finished", worker, requests=len(item.indices), left=held, held=held)

    def _released(self, worker: int, item: ReleasedRequests) -> None:
        self.ledger.released(worker, item.indices)
        tasks = []
        for i, partial in zip(item.indices, item.partials):
            self.moved.add(i)
            recipient = self.moving.pop(i, None)
            tasks.append(
                Task(i, partial, self.ledger.attempts[i], recipient if recipient in self.pool.workers else None)
            )
        self.queue.push_front(tasks)
        generated = sum(p.num_generated for p in item.partials if p is not None)
        self._event("released", worker, requests=len(tasks), generated=generated, held=len(self.ledger.on(worker)))

    def _add_counts(self, end: ShardEnd) -> None:
        self.result.counts = self.result.counts + end.counts
        if end.samples:
            self.spot.buffer.add(end.samples)

    # -- faults --------------------------------------------------------------------------------
    def _worker_died(self, worker: int, error: BaseException) -> None:
        self.sessions.pop(worker, None)
        self.pool.mark_dead(worker, error)
        self.spot.forget_worker(worker)
        self.result.died += 1
        lost = self.ledger.worker_lost(worker)
        if lost:
            for i, _ in lost:
                self.moving.pop(i, None)
            self.queue.push_front([Task(i, attempt=a) for i, a in lost])
            self._event("rerun", worker, requests=len(lost), attempt=max(a for _, a in lost))
            logger.warning("re-running %d unfinished requests of dead worker %d", len(lost), worker)
        self._worker_gone(worker)

    def _worker_gone(self, worker: int) -> None:
        """Work promised to a dead worker goes to the others."""
        self.idle.discard(worker)
        if self.pairs is not None:
            if (host := self.pairs.unpair(worker)) is not None and host in self.pool.workers:
                self.idle.add(host)
            self.pairs.host_gone(worker)
        for i in [i for i, w in self.moving.items() if w == worker]:
            del self.moving[i]  # its release may still arrive: then anyone takes it
        self.queue.release_moved_for(worker)
        if self.pool.workers or not len(self.queue):
            return
        if not self.respawn:
            raise RuntimeError("every rollout worker died (respawn_dead_workers is off)")
        self.idle.add(self.pool.spawn())


def collect_chunk(spot: SpotTraining, pool: WorkerPool) -> str:
    """Take the running chunk's result (waiting for it if it is still running): ``done`` (the
    newest state), ``lost`` (its worker died) or ``failed`` (it raised)."""
    chunk = spot.running
    try:
        result = pool.actors.get(chunk.ref)
    except ActorDied as e:
        pool.mark_dead(chunk.worker, e)
        spot.lost()
        return "lost"
    except CallFailed as e:
        spot.failed(e)
        return "failed"
    spot.finished(result)
    return "done"
