"""TLT-style spot training: the drafter's trained part (an EAGLE-3 head, or a drafter LM's own
weights) trains on workers the long tail leaves idle.

:class:`SpotTraining` decides when a chunk of training steps starts (a worker is idle while
another still generates, nothing waits to be generated, data is there, the rollout's step budget
is not spent), where (the worker whose trainer already holds the newest state, so only new samples
travel), on what (each recorded sample goes to a worker once), and what a chunk's outcome does
to the newest drafter state: a finished chunk replaces it (optimizer state included), a chunk lost
with its worker leaves no trace (training resumes from the last state), a chunk that raised turns
spot training off for the rollout. A chunk is told to stop when work arrives for its worker or
(``RolloutCoordinator.settle``) when the next rollout starts: it may train on through the trainer's
update. A stop names its chunk by number (it can arrive before the chunk's own call), and the
chunk yields before its next step; the next rollout waits for it at most a few seconds.

Training and shipping are apart: ``state`` is the newest *trained* state (chunks continue from
it), ``shipped`` the one the engines draft with. A finished chunk is shipped only when its worker
measured it better than the shipped head (a copy it keeps, sent when it is behind) on held-out
samples (recorded samples it never trains on) by more than ``ship_min_gain`` accepted draft
tokens per chain; otherwise training goes on from it and the engines (and their selectors'
goodput for model arms) keep the version they have. A stop cuts the comparison short too (a chunk
yields within one training step): the state is then *unjudged*, and the next chunk compares before
it trains, shipping at once if the state wins.

A chunk runs on the worker's :class:`~tailspec.workers.spot_chunk.SpotTrainer` (the training
copy, the held-out samples, the judgement). The actor system is passed in (anything
with :meth:`tailspec.actors.Actors.call`), so the decisions are tested with fake actors.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..actors import Actors
from ..drafter.online_training import DrafterState
from .spot_chunk import TrainResult

logger = logging.getLogger(__name__)

_CHUNK_NUMBERS = itertools.count()  # rising over every chunk this process starts (workers compare them)


@dataclass
class SpotTally:
    """Training done since the last :meth:`SpotTraining.take_tally` (reported per rollout)."""

    steps: int = 0
    losses: list[float] = field(default_factory=list)
    died: int = 0  # workers lost while training
    shipped: int = 0  # chunks whose state became the drafting head
    held: int = 0  # chunks kept back: no better than the shipped head on held-out samples
    held_out: list[tuple[float, float]] = field(default_factory=list)  # (shipped, trained) per chunk


@dataclass
class Chunk:
    ref: Any  # the running ``train_drafter`` call
    worker: int
    number: int  # rising over the coordinator's chunks: a stop names the chunk it is for
    stop_sent: bool = False


class SampleBuffer:
    """Recorded training data, newest kept under a byte cap; every sample has a rising id."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: deque[tuple[int, Any]] = deque()  # (id, sample), oldest first
        self.nbytes = 0
        self.next_id = 0

    def add(self, samples: list[Any]) -> None:
        for s in samples:
            if s.nbytes > self.max_bytes:
                continue
            self.items.append((self.next_id, s))
            self.next_id += 1
            self.nbytes += s.nbytes
            while self.nbytes > self.max_bytes:
                self.nbytes -= self.items.popleft()[1].nbytes

    def newer_than(self, sample_id: int) -> list[Any]:
        return [s for i, s in self.items if i > sample_id]

    def __len__(self) -> int:
        return len(self.items)


class SpotTraining:
    def __init__(
        self,
        state: DrafterState | None,
        *,
        actors: Actors,
        enabled: bool,
        steps_per_chunk: int,
        max_steps_per_rollout: int,
        buffer_bytes: int,
        event: Callable[..., None],
        holdout_every: int = 0,
        ship_min_gain: float = 0.0,
    ) -> None:
        self.actors = actors
        self.state = state  # the newest trained drafter state (None: no trained part, nothing to train)
        self.shipped = state  # the state the engines draft with
        self.holdout_every = holdout_every
        self.ship_min_gain = ship_min_gain
        self.lr_scale = 1.0  # of the learning rate, for chunks from now on (catch-up, drafter/catch_up.py)
        # ``state`` has steps no held-out comparison has judged (a stop cut it short): the next
        # chunk judges it before it trains
        self.unjudged = False
        self.enabled = enabled and state is not None
        self.steps_per_chunk = steps_per_chunk
        self.max_steps_per_rollout = max_steps_per_rollout
        self.buffer = SampleBuffer(buffer_bytes)
        self.running: Chunk | None = None
        self.tally = SpotTally()
        self._event = event
        self._sent_upto: dict[int, int] = {}  # worker -> highest sample id it has been sent
        self._trainer_holds: dict[int, int] = {}  # worker -> drafter version its own trainer holds
        self._reference_holds: dict[int, int] = {}  # worker -> shipped version its copy to beat holds
        self._last_trainer: int | None = None
        self._failed = False  # a chunk raised this rollout: no more chunks until the next one
        self._rollout_steps = 0

    # -- per rollout ---------------------------------------------------------------------------
    def start_rollout(self) -> None:
        self._failed = False
        self._rollout_steps = 0

    def take_tally(self) -> SpotTally:
        tally, self.tally = self.tally, SpotTally()
        return tally

    @property
    def training_worker(self) -> int | None:
        return self.running.worker if self.running is not None else None

    # -- when and where --------------------------------------------------------------------------
    def can_train(self) -> bool:
        """On, no chunk out, none failed this rollout, step budget left, data recorded."""
        return (
            self.enabled
            and self.running is None
            and not self._failed
            and self.steps_left() > 0
            and len(self.buffer) > 0
        )

    def should_start(self, *, others_generating: bool, work_waiting: bool) -> bool:
        """In a rollout: only while someone is still in the tail and nothing waits to be dealt."""
        return self.can_train() and others_generating and not work_waiting

    def steps_left(self) -> int:
        return self.max_steps_per_rollout - self._rollout_steps

    def pick_worker(self, idle: set[int]) -> int:
        """The last trainer if idle (it holds the optimizer state), else the lowest index."""
        return self._last_trainer if self._last_trainer in idle else min(idle)

    def chunk_args(self, worker: int, steps: int | None = None) -> tuple[DrafterState | None, list[Any], int]:
        """(state to start from, or None when the worker's trainer holds the newest; the samples
        it has not been sent; the step count: ``steps`` or ``steps_per_chunk``, within the
        rollout's budget) for a chunk on ``worker``; marks the samples sent."""
        assert self.state is not None
        new = self.buffer.newer_than(self._sent_upto.get(worker, -1))
        self._sent_upto[worker] = self.buffer.next_id - 1
        holds = self._trainer_holds.get(worker) == self.state.version
        steps = min(self.steps_per_chunk if steps is None else steps, self.steps_left())
        return (None if holds else self.state), new, steps

    def reference_for(self, worker: int) -> DrafterState | None:
        """The shipped state, when ``worker``'s copy to beat is not it (None otherwise); marks it sent."""
        if self._reference_holds.get(worker) == self.shipped.version:
            return None
        self._reference_holds[worker] = self.shipped.version
        return self.shipped

    def start(self, worker: int, actor: Any, busy: list[int], steps: int | None = None) -> Chunk:
        state, new, steps = self.chunk_args(worker, steps)
        number = next(_CHUNK_NUMBERS)
        ref = self.actors.call(
            actor,
            "train_drafter",
            state,
            new,
            steps,
            self.buffer.max_bytes,
            self.holdout_every,
            self.reference_for(worker),
            self.ship_min_gain,
            self.lr_scale,
            self.unjudged and self.holdout_every > 0,
            number,
        )
        self.running = Chunk(ref, worker, number)
        self._last_trainer = worker
        self._event("spot_start", worker, version=self.state.version, busy=busy, steps=steps)
        return self.running

    def stop(self, actor: Any, *, rollout_over: bool) -> None:
        """Tell the running chunk to yield before its next step (once)."""
        if self.running is not None and not self.running.stop_sent:
            self.actors.call(actor, "stop_training", self.running.number)
            self.running.stop_sent = True
            self._event("spot_stop", self.running.worker, rollout_over=rollout_over)

    # -- outcomes ------------------------------------------------------------------------------
    def finished(self, result: TrainResult) -> None:
        """A chunk returned: its state is the newest trained one (only its worker's trainer holds
        it), and the drafting head if the worker measured it better than the shipped one on its
        held-out samples (then the worker's copy to beat is that state)."""
        worker = self.running.worker if self.running is not None else result.worker
        self.running = None
        self.state = result.state
        self._trainer_holds = {worker: result.state.version}
        self.tally.steps += len(result.losses)
        self.tally.losses += result.losses
        self._rollout_steps += len(result.losses)
        # compared with another version than the shipped one (a head published meanwhile): says
        # nothing about shipping; training goes on and the next chunk compares with the right one
        current = result.held_out is None or result.held_out_against == self.shipped.version
        ship = result.ship and current and (bool(result.losses) or result.state.version != self.shipped.version)
        if result.losses or result.held_out is not None:  # else: nothing trained, nothing judged
            self.unjudged = not result.judged
        if result.held_out is not None:
            self.tally.held_out.append(result.held_out)
        if ship:
            self.shipped = result.state
            self._reference_holds[worker] = result.state.version
            self.tally.shipped += 1
        elif result.losses and result.judged:
            self.tally.held += 1
            if result.ship:  # the worker's copy moved to a version that was not shipped
                self._reference_holds.pop(worker, None)
        self._event(
            "spot_done", worker, version=result.state.version, steps=len(result.losses), shipped=ship,
            held_out=result.held_out, judged=result.judged,
        )  # fmt: skip

    def lost(self) -> None:
        """The training worker died: the chunk leaves no trace."""
        worker = self.running.worker
        self.running = None
        self.tally.died += 1
        self.forget_worker(worker)
        logger.warning(
            "drafter training on worker %d was lost with it; training resumes from version %d",
            worker,
            self.state.version,
        )

    def failed(self, error: BaseException) -> None:
        worker = self.running.worker
        self.running = None
        self._failed = True
        self._trainer_holds.pop(worker, None)  # its trainer may have moved past our last state
        logger.error("drafter training failed on worker %d (no more this rollout): %s", worker, error)
        self._event("spot_failed", worker, error=str(error)[:200])

    def forget_worker(self, worker: int) -> None:
        self._sent_upto.pop(worker, None)
        self._trainer_holds.pop(worker, None)
        self._reference_holds.pop(worker, None)

    def publish(self, state: DrafterState) -> None:
        """A head trained elsewhere becomes the newest and the drafting one; no worker's optimizer
        state belongs to it."""
        self.state = self.shipped = state
        self.unjudged = False
        self._trainer_holds = {}
        self._reference_holds = {}

    def resume_training_from(self, state: DrafterState) -> None:
        """Continue training from ``state`` (a checkpoint's trained state, newer than the shipped one)."""
        self.state = state
        self.unjudged = True  # newer than the shipped head, and not known to beat it
        self._trainer_holds = {}
