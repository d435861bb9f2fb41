"""``RolloutWorker``: one engine (a policy copy and a drafter) in a Ray actor.

Spot training updates a copy of the EAGLE-3 head; the head the engine drafts with changes only
when the coordinator broadcasts a version, so all workers always draft with the same one.

The class is plain Python; :class:`tailspec.workers.RolloutCoordinator` wraps it with
``ray.remote`` (threaded, so ``stop_training`` can arrive while ``train_drafter`` runs). Every
call records :class:`WorkerEvent` s with a per-worker sequence number, so tests and logs can
reason about what happened in which order without reading clocks.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..draft_contract import Portable
from ..drafter.eagle3 import Eagle3Head, FeatureBuffer
from ..drafter.eagle3.data import Eagle3Sample
from ..drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig, held_out_acceptance
from ..drafter.factory import as_drafter
from ..drafter.online import DrafterState
from ..rollout.engine import RolloutEngine
from ..rollout.handoff import InboxItem, PartialRequest, RequestInbox
from ..rollout.params import RolloutConfig
from ..rollout.request import RequestOutput

logger = logging.getLogger(__name__)

STAT_KEYS = (
    "generated_tokens",
    "drafted_tokens",
    "accepted_tokens",
    "spec_emitted_tokens",
    "spec_seq_steps",
    "draft_time_s",
    "verify_time_s",
    "tail_time_s",
    "preemptions",
)


HELD_OUT_SAMPLES = 24  # the newest held-out samples heads are compared on: what the policy writes now


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
    samples: list[Eagle3Sample]  # EAGLE-3 training data recorded while generating
    stats: dict[str, float]  # engine counters for this call (deltas)
    strategy_steps: dict[str, int]
    seconds: float
    policy_version: int
    drafter_version: int | None


@dataclass
class TrainResult:
    worker: int
    state: DrafterState
    losses: list[float]
    stopped: bool  # yielded before max_steps (rollout over or work arrived)
    # (drafting head's, trained head's) accepted draft tokens per chain on the held-out samples;
    # None while none is held out
    held_out: tuple[float, float] | None = None
    held_out_against: int | None = None  # the shipped version the trained head was compared with
    ship: bool = True  # the trained head beat it (or nothing was held out): the engines should draft with it
    # False: a stop cut the comparison short, so the state is neither shipped nor known to lose
    judged: bool = True


def _beats(held_out: tuple[float, float], gain: float) -> bool:
    """The trained head's held-out score beats the shipped head's by more than ``gain``."""
    shipped, trained = held_out
    return trained > shipped + gain


class RolloutWorker:
    """An engine on a policy copy; optionally trains the EAGLE-3 head between rollouts' work."""

    def __init__(
        self,
        index: int,
        model: torch.nn.Module,
        rollout_config: RolloutConfig,
        eos_token_ids: list[int],
        drafter: Any = None,
        drafter_state: DrafterState | None = None,
        training_config: DrafterTrainingConfig | None = None,
        policy_version: int = 0,
        num_threads: int | None = None,
        sample_buffer_mb: int = 64,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.index = index
        if torch.cuda.is_available():  # a GPU actor: Ray made exactly its GPU visible
            model = model.to("cuda")
            drafter = drafter.to("cuda") if isinstance(drafter, torch.nn.Module) else drafter
        self.model = model.eval()
        self.policy_version = policy_version
        self.training_config = training_config
        self.sample_buffer_bytes = sample_buffer_mb << 20
        self._events: list[WorkerEvent] = []
        # chunk numbers (the coordinator's): the running one, and the highest told to stop. A stop
        # may overtake its chunk's call (the actor is threaded, and the call carries the samples),
        # so it names the chunk instead of setting a flag the chunk would clear
        self._chunk = -1
        self._stopped_upto = -1
        self._lock = threading.Lock()
        self._inbox: RequestInbox | None = None  # the running serving session's
        self._early = RequestInbox()  # calls for the next session that arrive before it starts
        self.head: Eagle3Head | None = drafter if isinstance(drafter, Eagle3Head) else None
        self.trainer: DrafterTrainer | None = None
        self.train_buffer: FeatureBuffer | None = None  # samples sent for spot training, kept between chunks
        self.train_head: Eagle3Head | None = None  # the copy spot training updates
        self.held_out: deque[Eagle3Sample] = deque(maxlen=HELD_OUT_SAMPLES)  # never trained on
        self.reference: Eagle3Head | None = None  # a copy of the shipped head, what a trained one must beat
        self._held_out_added = 0
        self._reference_score: tuple[tuple[int, int], float] | None = None  # ((version, held-out adds), score)
        self._samples_received = 0
        self._draft_host: tuple[int, Any] | None = None  # (pairing, SequencedHost): drafting for a busy peer
        self._hosted_commands = 0
        engine_drafter = drafter
        if self.head is not None:
            if drafter_state is not None:
                drafter_state.load_into(self.head)
            engine_drafter = as_drafter(
                self.head, self.model, rollout_config, buffer=FeatureBuffer(self.sample_buffer_bytes)
            )
        self.eagle_drafter = engine_drafter if self.head is not None else None
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
        return self.policy_version, (int(self.head.version) if self.head is not None else None)

    # -- rollout work ------------------------------------------------------------------------
    def serve_stream(
        self,
        items: list[InboxItem],
        total: int | None = None,
        policy_state: dict[str, torch.Tensor] | None = None,
        policy_version: int | None = None,
        drafter_state: DrafterState | None = None,
    ) -> Iterator[FinishedRequests | ReleasedRequests | ShardEnd]:
        """A serving session: starts with ``items``; more arrive by :meth:`submit` (they join the
        running batch), :meth:`release` gives requests back, and :meth:`close_session` (or
        ``total``, the session's item count if known up front) ends it once everything is done.
        Streams :class:`FinishedRequests` / :class:`ReleasedRequests` as they happen, then one
        :class:`ShardEnd`. Policy weights or a drafter version this worker lacks come with the
        call (the coordinator sends them only when stale) and are loaded first."""
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
        before = self.engine.stats.as_dict()
        before_steps = dict(self.engine.stats.strategy_steps)
        served = 0
        try:
            for update in self.engine.serve(inbox):
                if update.finished:
                    served += len(update.finished)
                    yield FinishedRequests(self.index, [k for k, _ in update.finished], [o for _, o in update.finished])
                if update.released:
                    yield ReleasedRequests(self.index, [k for k, _ in update.released], [p for _, p in update.released])
        finally:
            with self._lock:
                self._inbox = None
        yield self._session_end(served, before, before_steps, time.perf_counter() - start)

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

    def _session_end(self, served: int, before: dict, before_steps: dict, seconds: float) -> ShardEnd:
        after = self.engine.stats.as_dict()
        samples: list[Eagle3Sample] = []
        if self.eagle_drafter is not None:  # hand the recorded data over and start a fresh buffer
            samples = self.eagle_drafter.buffer.samples()
            self.eagle_drafter.buffer = FeatureBuffer(self.sample_buffer_bytes)
        self._event("generate_end", requests=served, samples=len(samples))
        return ShardEnd(
            worker=self.index,
            requests=served,
            samples=samples,
            stats={k: after[k] - before[k] for k in STAT_KEYS},
            strategy_steps={
                k: v - before_steps.get(k, 0)
                for k, v in self.engine.stats.strategy_steps.items()
                if v > before_steps.get(k, 0)
            },
            seconds=seconds,
            policy_version=self.policy_version,
            drafter_version=int(self.head.version) if self.head is not None else None,
        )

    def engine_state(self) -> dict:
        """The engine's learned state (selector, suffix history) for a checkpoint."""
        return self.engine.state_dict()

    def load_engine_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def set_length_budget(self, ratio: float) -> None:
        """Turn the engine's length-aware draft budget on (``ratio`` in (0, 1]) or off (0)."""
        if not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
            raise ValueError(f"length_budget must be a number in [0, 1] (0 = off), got {ratio!r}")
        self.engine.config.length_budget = float(ratio)

    def set_policy(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Load new policy weights in place (the engine keeps its caches; nothing is mid-flight)."""
        self.model.load_state_dict(state_dict)
        self.policy_version = version
        self._event("policy", version=version)
        return version

    def set_drafter(self, state: DrafterState) -> int:
        if self.head is None:
            raise RuntimeError(f"worker {self.index} has no EAGLE-3 head to load a drafter state into")
        state.load_into(self.head)  # the drafting head; spot training's copy and optimizer stay as they are
        self._event("drafter", version=state.version)
        return state.version

    # -- spot drafter training ---------------------------------------------------------------
    def train_drafter(
        self,
        state: DrafterState | None,
        new_samples: list[Eagle3Sample],
        max_steps: int,
        buffer_bytes: int,
        holdout_every: int = 0,
        shipped: DrafterState | None = None,
        ship_min_gain: float = 0.0,
        lr_scale: float = 1.0,
        judge_first: bool = False,
        chunk: int | None = None,
    ) -> TrainResult:
        """Up to ``max_steps`` training steps, checking for :meth:`stop_training` before every one.

        ``new_samples`` are added to this worker's training buffer (the coordinator sends each
        sample once per worker; ``buffer_bytes`` caps it, newest kept, as the coordinator's own),
        but every ``holdout_every``-th one (0: none) goes to a held-out set instead. ``state`` is
        where to start from, or None to continue from this worker's own trainer, which must then
        hold the coordinator's latest version. After the steps the trained head is compared on the
        held-out set with the shipped one (``shipped``: its state, sent when this worker's copy is
        not it) by :func:`held_out_acceptance`, and ships when it is better by more than
        ``ship_min_gain`` (then it is the copy to beat from now on). ``lr_scale`` multiplies the
        learning rate (catch-up, ``drafter/catch_up.py``). Returns the new state.

        A stop also cuts the comparison short (it is checked before every batch of held-out
        samples), so a chunk yields within one training step: the result is then not judged
        (``judged=False``, no ship). ``judge_first`` (the coordinator's newest state was never
        judged) compares before training: a head that wins ships at once, with no new steps.
        ``chunk`` numbers the call (rising), so that a stop sent for it takes effect even when it
        arrives first; None: the next number."""
        if self.head is None:
            raise RuntimeError(f"worker {self.index} has no EAGLE-3 head to train")
        self._chunk = self._stopped_upto + 1 if chunk is None else chunk
        self._take_samples(new_samples, buffer_bytes, holdout_every)
        self._event("train_start", from_version=None if state is None else state.version, new=len(new_samples))
        self._prepare_trainer(state, shipped, lr_scale)
        judging = bool(holdout_every and self.held_out)
        against = int(self.reference.version)
        held_out = None
        if judge_first and judging:
            held_out = self._compare_on_held_out()
            if held_out is None or _beats(held_out, ship_min_gain):  # cut short, or ships as it is
                shipping = held_out is not None
                return self._train_result([], held_out, against, ship=shipping, stopped=not shipping, judged=shipping)
        results = self.trainer.train(max_steps, should_stop=self._stop_asked) if len(self.train_buffer) else []
        losses = [r.loss for r in results]
        for r in results:
            self._event("train_step", step=r.step, loss=r.loss, seconds=round(r.time_s, 3))
        if losses and judging:
            judging_from = time.perf_counter()
            held_out = self._compare_on_held_out()
            self._event("judged", seconds=round(time.perf_counter() - judging_from, 3), done=held_out is not None)
        judged = held_out is not None or not judging
        ship = bool(losses) and judged and (held_out is None or _beats(held_out, ship_min_gain))
        return self._train_result(losses, held_out, against, ship=ship, stopped=len(losses) < max_steps, judged=judged)

    def _take_samples(self, new_samples: list[Eagle3Sample], buffer_bytes: int, holdout_every: int) -> None:
        """Into the training buffer (``buffer_bytes``, newest kept), every ``holdout_every``-th (0:
        none) into the held-out set instead."""
        if self.train_buffer is None or self.train_buffer.max_bytes != buffer_bytes:
            self.train_buffer = FeatureBuffer(buffer_bytes)
        for sample in new_samples:
            self._samples_received += 1
            if holdout_every and self._samples_received % holdout_every == 0:
                self.held_out.append(sample)
                self._held_out_added += 1
            else:
                self.train_buffer.add(sample)

    def _prepare_trainer(self, state: DrafterState | None, shipped: DrafterState | None, lr_scale: float) -> None:
        """The copy that trains (apart from the drafting head, which changes only by broadcast), from
        ``state`` or continuing; the reference to beat, set to ``shipped`` when sent."""
        if self.train_head is None:
            self.train_head = copy.deepcopy(self.head)
            self.reference = copy.deepcopy(self.head)
        if shipped is not None:
            shipped.load_into(self.reference)
        if state is not None:
            state.load_into(self.train_head)
            self.trainer = DrafterTrainer(
                self.train_head, self.model.get_input_embeddings(), self.train_buffer, self.training_config
            )
            if state.optimizer is not None:
                self.trainer.optimizer.load_state_dict(state.optimizer)
            self.trainer.step_count = state.step
        elif self.trainer is None:
            raise RuntimeError(f"worker {self.index} has no trainer to continue; send a DrafterState")
        self.trainer.buffer = self.train_buffer
        self.trainer.lr_scale = lr_scale

    def _train_result(
        self,
        losses: list[float],
        held_out: tuple[float, float] | None,
        against: int,
        *,
        ship: bool,
        stopped: bool,
        judged: bool = True,
    ) -> TrainResult:
        if ship:  # the copy to beat from now on
            self.reference.load_state_dict(self.train_head.state_dict())
            self.reference.version = self.train_head.version
        self._event(
            "train_end", version=int(self.train_head.version), steps=len(losses), stopped=stopped, ship=ship,
            judged=judged,
        )  # fmt: skip
        state = DrafterState.of(self.train_head, self.trainer)
        return TrainResult(self.index, state, losses, stopped, held_out, against, ship, judged)

    def _compare_on_held_out(self) -> tuple[float, float] | None:
        """(shipped head's, trained head's) accepted draft tokens per chain on the held-out samples,
        or None when a stop cut it short; the shipped head's score is reused while neither it nor
        the held-out set changed."""
        embed, samples = self.model.get_input_embeddings(), list(self.held_out)
        depth, stop = self.trainer.config.ttt_steps, self._stop_asked
        key = (int(self.reference.version), self._held_out_added)
        if self._reference_score is None or self._reference_score[0] != key:
            score = held_out_acceptance(self.reference, embed, samples, depth, should_stop=stop)
            if score is None:
                return None
            self._reference_score = (key, score)
        trained = held_out_acceptance(self.train_head, embed, samples, depth, should_stop=stop)
        return None if trained is None else (self._reference_score[1], trained)

    def stop_training(self, chunk: int | None = None) -> None:
        """Make :meth:`train_drafter` call ``chunk`` (None: the running one) return before its next
        step, or at once if it has not started yet."""
        self._stopped_upto = max(self._stopped_upto, self._chunk if chunk is None else chunk)

    def _stop_asked(self) -> bool:
        return self._stopped_upto >= self._chunk

    # -- Mirror-SD across workers ------------------------------------------------------------
    def can_host_drafts(self) -> bool:
        """Whether this worker's engine drafts mirror branches with a drafter that can run in a
        peer (a drafter LM; an EAGLE-3 head reads this worker's target features and cannot)."""
        return self.engine.mirror_capable

    def use_draft_host(self, host: Any | None, pairing: int = 0) -> bool:
        """Draft this worker's mirror branches on ``host`` (another worker's actor, idle in the
        tail) from the next step on; None: on this worker's own executor again. False (and nothing
        changes) when this worker's engine has no mirror steps to hand over."""
        from ..rollout.draft_executor import PeerExecutor

        if host is None:
            self.engine.use_draft_executor(None)
            self._event("draft_host", host=None)
            return True
        if not self.engine.mirror_capable:
            return False
        self.engine.use_draft_executor(PeerExecutor(host, pairing, source=self.engine.drafter))
        self._event("draft_host", pairing=pairing)
        return True

    def host_drafts(self, pairing: int, number: int, command: str, args: tuple):
        """One command of a busy worker's :class:`PeerExecutor`: this worker's spare compute drafts
        that worker's branches, with a drafter built from its own copy (fresh for each pairing)."""
        from ..rollout.draft_executor import ExecutorError, SequencedHost

        with self._lock:
            if self._draft_host is None or self._draft_host[0] < pairing:
                if not isinstance(self.engine.drafter, Portable):
                    raise ExecutorError(f"worker {self.index} has no drafter that can draft for another")
                self._draft_host = (pairing, SequencedHost(self.engine.drafter.rebuild()))
                self._events.append(WorkerEvent(len(self._events), "hosting", {"pairing": pairing}))
            held, host = self._draft_host
            self._hosted_commands += 1
        if held != pairing:
            raise ExecutorError(f"draft command for pairing {pairing}; worker {self.index} now hosts {held}")
        return host.handle(number, command, args)

    def hosted_commands(self) -> int:
        """Draft commands this worker has answered for peers."""
        return self._hosted_commands
