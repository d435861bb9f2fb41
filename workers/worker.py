"""``RolloutWorker``: one engine (a policy copy and a drafter) in a Ray actor.

Spot training updates a copy of the drafter's trained part (an EAGLE-3 head, or a drafter LM's
weights); the part the engine drafts with changes only when the coordinator broadcasts a version,
so all workers always draft with the same one.

The class is plain Python; :class:`tailspec.workers.RolloutCoordinator` starts it as an actor
(:mod:`tailspec.actors`; threaded, so ``stop_training`` can arrive while ``train_drafter`` runs). Every
call records :class:`WorkerEvent` s with a per-worker sequence number, so tests and logs can
reason about what happened in which order without reading clocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..actors import Actors, RayActors
from ..draft_contract import Portable
from ..drafter.eagle3 import Eagle3Head, FeatureBuffer
from ..drafter.factory import DrafterFor, as_drafter
from ..drafter.lm_trainer import SequenceSample
from ..drafter.online_training import DrafterState
from ..drafter.part_learning import learner_for
from ..rollout.engine import RolloutEngine
from ..rollout.handoff import InboxItem, PartialRequest, RequestInbox
from ..rollout.params import RolloutConfig
from ..rollout.request import RequestOutput
from ..rollout.stats import EngineCounts
from .spot_chunk import SpotTrainer, TrainResult

logger = logging.getLogger(__name__)


@dataclass
class WorkerEvent:
    seq: int  # per-worker order
    kind: str  # generate_start | generate_end | train_start | train_step | train_end | policy | drafter
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class FinishedRequests:
    """Requests of a shard that finished in one engine step, streamed as they finish."""

    worker: int
    indices: list[int]  # the coordinator's request indices
    outputs: list[RequestOutput]


@dataclass
class ReleasedRequests:
    """Requests given back at the coordinator's request (to move them to another worker):
    ``partials[i]`` continues ``indices[i]`` elsewhere (None: it had not started)."""

    worker: int
    indices: list[int]
    partials: list[PartialRequest | None]


@dataclass
class ShardEnd:
    """The last item of a serving session's stream: what the worker recorded and counted meanwhile."""

    worker: int
    requests: int
    # training data recorded while generating: EAGLE-3 features, or the finished requests' sequences
    samples: list[Any]
    counts: EngineCounts  # what the engine counted in this session
    seconds: float
    policy_version: int
    drafter_version: int | None


class RolloutWorker:
    """An engine on a policy copy; optionally trains the drafter's trained part between rollouts' work."""

    def __init__(
        self,
        index: int,
        model: torch.nn.Module,
        rollout_config: RolloutConfig,
        eos_token_ids: list[int],
        drafter: Any = None,
        drafter_state: DrafterState | None = None,
        training_config: Any = None,
        policy_version: int = 0,
        num_threads: int | None = None,
        actors: Actors | None = None,
        sample_buffer_mb: int = 64,
    ) -> None:
        """``actors``: the system this worker runs in, through which it calls a peer it drafts on
        (:meth:`use_draft_host`); ``num_threads``: torch's intra-op threads (None: left as they are)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.index = index
        self.actors = actors or RayActors()
        if torch.cuda.is_available():  # a GPU actor: Ray made exactly its GPU visible
            model = model.to("cuda")
            drafter = drafter.to("cuda") if isinstance(drafter, torch.nn.Module) else drafter
        self.model = model.eval()
        self.policy_version = policy_version
        self.sample_buffer_bytes = sample_buffer_mb << 20
        self._events: list[WorkerEvent] = []
        self._lock = threading.Lock()
        self._inbox: RequestInbox | None = None  # the running serving session's
        self._early = RequestInbox()  # calls for the next session that arrive before it starts
        self._draft_host: tuple[int, Any] | None = None  # (pairing, SequencedHost): drafting for a busy peer
        self._hosted_commands = 0
        # the part spot training trains (an EAGLE-3 head, a drafter LM's weights) and how it learns
        learning = learner_for(drafter, self.model, training_config)
        self.part, learner = learning if learning is not None else (None, None)
        if self.part is not None and drafter_state is not None:
            drafter_state.load_into(self.part)
        engine_drafter = drafter
        self.eagle_drafter = None  # an EAGLE-3 head's engine drafter records the features it trains on
        if isinstance(drafter, Eagle3Head):
            buffer = FeatureBuffer(self.sample_buffer_bytes)

            def head_drafter(target: torch.nn.Module) -> Any:  # the engine's model: its copy in config.dtype
                self.eagle_drafter = as_drafter(drafter, target, rollout_config, buffer=buffer)
                return self.eagle_drafter

            engine_drafter = DrafterFor(head_drafter)
        self.records_sequences = learner is not None and learner.records == "sequences"
        self._sequences: list[SequenceSample] = []  # the finished requests' of this session
        # the worker's side of spot training (workers/spot_chunk.py), with a part to train
        self.spot = SpotTrainer(index, self.part, learner, self._event) if self.part is not None else None
        self.engine = RolloutEngine(self.model, rollout_config, eos_token_ids=eos_token_ids, drafter=engine_drafter)

    # -- bookkeeping -----------------------------------------------------------------------
    def _event(self, kind: str, **detail: Any) -> None:
        with self._lock:
            self._events.append(WorkerEvent(len(self._events), kind, detail))

    def events(self) -> list[WorkerEvent]:
        with self._lock:
            return list(self._events)

    def ping(self) -> int:
        return self.index

    def versions(self) -> tuple[int, int | None]:
        """(policy version, drafter version)."""
        return self.policy_version, (int(self.part.version) if self.part is not None else None)

    # -- rollout work ------------------------------------------------------------------------
    def serve_stream(
        self,
        items: list[InboxItem],
        total: int | None = None,
        policy_state: dict[str, torch.Tensor] | None = None,
        policy_version: int | None = None,
        drafter_state: DrafterState | None = None,
        expected_batch: int | None = None,
    ) -> Iterator[FinishedRequests | ReleasedRequests | ShardEnd]:
        """A serving session: starts with ``items``; more arrive by :meth:`submit` (they join the
        running batch), :meth:`release` gives requests back, and :meth:`close_session` (or
        ``total``, the session's item count if known up front) ends it once everything is done.
        Streams :class:`FinishedRequests` / :class:`ReleasedRequests` as they happen, then one
        :class:`ShardEnd`. Policy weights or a drafter version this worker lacks come with the
        call (the coordinator sends them only when stale) and are loaded first. ``expected_batch``:
        the most requests the session will hold at once, if known (``adaptive`` calibrates for it)."""
        if expected_batch is not None:
            self.engine.expect_batch(expected_batch)
        if policy_state is not None:
            self.set_policy(policy_state, policy_version if policy_version is not None else self.policy_version)
        if drafter_state is not None:
            self.set_drafter(drafter_state)
        with self._lock:  # calls that overtook this one (a threaded actor runs calls on several threads)
            inbox, self._inbox = self._early, None
            self._early = RequestInbox()
            inbox.put(items)
            if total is not None:
                inbox.close(total)
            self._inbox = inbox
        self._event("generate_start", requests=len(items), policy=self.policy_version)
        start = time.perf_counter()
        before = self.engine.stats.counts()
        served = 0
        try:
            for update in self.engine.serve(inbox):
                if update.finished:
                    served += len(update.finished)
                    if self.records_sequences:
                        self._sequences += [
                            SequenceSample.of(o.prompt_ids, o.completion_ids) for _, o in update.finished
                        ]
                    yield FinishedRequests(self.index, [k for k, _ in update.finished], [o for _, o in update.finished])
                if update.released:
                    yield ReleasedRequests(self.index, [k for k, _ in update.released], [p for _, p in update.released])
        finally:
            with self._lock:
                self._inbox = None
        yield self._session_end(served, before, time.perf_counter() - start)

    def submit(self, items: list[InboxItem]) -> int:
        """More requests for the running session (they start at its next step)."""
        with self._lock:
            (self._inbox or self._early).put(items)
        return len(items)

    def release(self, keys: list[int]) -> None:
        """Ask the running session to give ``keys`` back (answered by a :class:`ReleasedRequests`)."""
        with self._lock:
            (self._inbox or self._early).release(keys)

    def close_session(self, total: int) -> None:
        """The session gets ``total`` items in all; it ends once they are all done or given back."""
        with self._lock:
            (self._inbox or self._early).close(total)

    def _session_end(self, served: int, before: EngineCounts, seconds: float) -> ShardEnd:
        samples: list[Any] = []
        if self.eagle_drafter is not None:  # hand the recorded data over and start a fresh buffer
            samples = self.eagle_drafter.buffer.samples()
            self.eagle_drafter.buffer = FeatureBuffer(self.sample_buffer_bytes)
        elif self.records_sequences:
            samples, self._sequences = [s for s in self._sequences if s.num_tokens > s.prompt_len], []
        self._event("generate_end", requests=served, samples=len(samples))
        return ShardEnd(
            worker=self.index,
            requests=served,
            samples=samples,
            counts=self.engine.stats.counts() - before,
            seconds=seconds,
            policy_version=self.policy_version,
            drafter_version=int(self.part.version) if self.part is not None else None,
        )

    def engine_state(self) -> dict:
        """The engine's learned state (selector, suffix history) for a checkpoint."""
        return self.engine.state_dict()

    def load_engine_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def acceptance_book(self) -> dict | None:
        """The adaptive selector's acceptance counts (``AcceptanceBook.state_dict``), None without one."""
        selector = self.engine.selector
        return selector.acceptance.state_dict() if selector is not None else None

    def merge_acceptance(self, merged: dict) -> None:
        """Adopt the acceptance book the coordinator averaged over every worker's."""
        if self.engine.selector is not None:
            self.engine.selector.merge_acceptance(merged)

    def set_length_budget(self, ratio: float) -> None:
        """Turn the engine's length-aware draft budget on (``ratio`` in (0, 1]) or off (0)."""
        if not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
            raise ValueError(f"length_budget must be a number in [0, 1] (0 = off), got {ratio!r}")
        self.engine.config.length_budget = float(ratio)

    def set_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Load new policy weights in place (the engine keeps its caches; nothing is mid-flight)."""
        self.model.load_state_dict(state_dict)
        self.engine.weights_changed()
        self.policy_version = version
        self._event("policy", version=version)
        return version

    def set_drafter(self, state: DrafterState) -> int:
        if self.part is None:
            raise RuntimeError(f"worker {self.index} has no trained drafter part to load a drafter state into")
        state.load_into(self.part)  # the drafting part; spot training's copy and optimizer stay as they are
        self._event("drafter", version=state.version)
        return state.version

    # -- spot drafter training ---------------------------------------------------------------
    def train_drafter(self, *args: Any, **kwargs: Any) -> TrainResult:
        """One spot-training chunk on this worker (:meth:`SpotTrainer.train`)."""
        if self.spot is None:
            raise RuntimeError(f"worker {self.index} has no drafter part to train (an EAGLE-3 head or a drafter LM)")
        return self.spot.train(*args, **kwargs)

    def stop_training(self, chunk: int | None = None) -> None:
        """Make the chunk numbered ``chunk`` (None: the running one) return before its next step."""
        if self.spot is not None:
            self.spot.stop(chunk)

    # -- Mirror-SD across workers ------------------------------------------------------------
    def use_draft_host(self, host: Any | None, pairing: int = 0) -> bool:
        """Draft this worker's mirror branches on ``host`` (another worker's actor, idle in the
        tail) from the next step on; None: on this worker's own executor again. False (and nothing
        changes) when this worker's engine has no mirror steps to hand over."""
        from .draft_hosts import PeerExecutor

        mirror = self.engine.drafters.mirror
        if host is None:
            if mirror is not None:
                mirror.use_executor(None)
            self._event("draft_host", host=None)
            return True
        if mirror is None or not mirror.hostable:
            return False
        mirror.use_executor(PeerExecutor(self.actors, host, pairing, source=self.engine.drafter))
        self._event("draft_host", pairing=pairing)
        return True

    def host_drafts(self, pairing: int, number: int, command: str, args: tuple):
        """One command of a busy worker's :class:`PeerExecutor`: this worker's spare compute drafts
        that worker's branches, with a drafter built from its own copy (fresh for each pairing)."""
        from ..rollout.mirror.executors import ExecutorError
        from ..rollout.mirror.hosted import SequencedHost

        with self._lock:
            if self._draft_host is None or self._draft_host[0] < pairing:
                if not isinstance(self.engine.drafter, Portable):
                    raise ExecutorError(f"worker {self.index} has no drafter that can draft for another")
                self._draft_host = (
                    pairing,
                    SequencedHost(self.engine.drafter.rebuild(), kernels=self.engine.config.kernels),
                )
                self._events.append(WorkerEvent(len(self._events), "hosting", {"pairing": pairing}))
            held, host = self._draft_host
            self._hosted_commands += 1
        if held != pairing:
            raise ExecutorError(f"draft command for pairing {pairing}; worker {self.index} now hosts {held}")
        return host.handle(number, command, args)

    def hosted_commands(self) -> int:
        """Draft commands this worker has answered for peers."""
        return self._hosted_commands
