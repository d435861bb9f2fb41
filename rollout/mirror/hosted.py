"""A copy of the drafter hosted elsewhere, in a draft process or a Ray actor: what crosses to it
(:class:`SeqSnapshot`: tokens and sampling parameters, never KV), the host that answers its
commands in order (:class:`DrafterHost`), the engine's handle on it (a ``Drafter`` whose calls
are commands), and the executors that reach a host by actor calls (``ray``, and the peer draft
hosts of ``workers/draft_hosts.py``). The ``process`` executor is in ``process_executor.py``.
"""

from __future__ import annotations

import io
import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...actors import Actors, RayActors, ray_module
from ...draft_contract import (
    BranchView,
    Drafter,
    DraftRequest,
    DraftsBranches,
    DraftShape,
    DraftStep,
    DraftTree,
    Portable,
    SequenceView,
    Settled,
    draft_from_text,
    observed_rows,
    propose_slot_by_slot,
)
from ...kernels.dispatch import kernel_backend
from ...kernels.transfers import select_rows
from .executors import DraftExecutor, ExecutorError

logger = logging.getLogger(__name__)


@dataclass
class SeqSnapshot:
    """What crosses to a drafter in another process for one sequence (satisfies ``SequenceView``)."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    group: int | None
    stop_ids: frozenset[int]
    params: object
    generator = None

    @classmethod
    def of(cls, seq: SequenceView) -> SeqSnapshot:
        return cls(seq.seq_id, list(seq.prompt_ids), list(seq.output_ids), seq.group, seq.stop_ids, seq.params)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]


def _snapshot(seq: SequenceView) -> SequenceView:
    if isinstance(seq, BranchView):
        return BranchView(SeqSnapshot.of(seq.seq), seq.extra, seq.fork)
    return SeqSnapshot.of(seq)


def snapshots(requests: Sequence[DraftRequest]) -> list[tuple[SequenceView, int]]:
    return [(_snapshot(r.seq), r.max_depth) for r in requests]


ANSWERED = ("propose", "branches", "ping")


class DrafterHost:
    """A drafter answering commands in the order they come: what runs in a draft process or in
    a Ray actor. ``propose``/``branches`` return the drafts, ``ping`` None (a round trip of the
    channel); the other commands are the drafter's own calls and return nothing. Each runs under
    ``kernel_backend(kernels)``, the engine's ``RolloutConfig.kernels``: a process or an actor
    starts without the engine's context."""

    def __init__(self, build: Callable[[], Drafter], threads: int | None = None, kernels: str = "auto") -> None:
        if threads:
            torch.set_num_threads(threads)
        self.kernels = kernels
        self.drafter = build()

    def handle(self, command: str, args: tuple):
        with kernel_backend(self.kernels):
            return self._handle(command, args)

    def _handle(self, command: str, args: tuple):
        if command in ("propose", "branches"):
            snaps, shape = args
            requests = [DraftRequest(s, depth) for s, depth in snaps]
            method = self.drafter.propose if command == "propose" else self.drafter.propose_branches
            return [DraftTree(t.tokens, t.parents, t.draft_probs) for t in method(requests, shape)]
        if command == "ping":
            return None
        if command == "weights":
            self.drafter.load_weights(*args)
        elif command == "features":  # a feature-reading drafter's rows of the engine's last forward
            for seq_id, start, rows in args[0]:
                self.drafter.add_features(seq_id, start, torch.from_numpy(rows))
        elif command in ("settled", "truncate", "release", "finished"):
            getattr(self.drafter, command)(*args)
        else:
            raise ValueError(f"unknown draft command {command!r}")
        return None


class SequencedHost:
    """A :class:`DrafterHost` for callers whose calls may arrive out of order (a threaded Ray
    actor runs its calls on several threads): every command carries its number and waits until
    all before it are handled, so the drafter sees them in the order they were sent."""

    def __init__(self, build: Callable[[], Drafter], wait_s: float = 60.0, kernels: str = "auto") -> None:
        self._host = DrafterHost(build, kernels=kernels)
        self._next = 0
        self._turn = threading.Condition()
        self._wait_s = wait_s

    def handle(self, number: int, command: str, args: tuple):
        with self._turn:
            if not self._turn.wait_for(lambda: self._next >= number, timeout=self._wait_s):
                raise ExecutorError(f"draft command {number} waited {self._wait_s:.0f} s for command {self._next}")
            if self._next != number:
                raise ExecutorError(f"draft command {number} arrived twice")
            try:
                return self._host.handle(command, args)
            finally:
                self._next += 1
                self._turn.notify_all()


class _RemoteDrafter(Drafter, DraftsBranches):
    """The engine's handle on a drafter across a boundary (``executor.call`` waits for the
    answer, ``executor.tell`` sends in order and does not wait): it drafts from text only."""

    name = "remote"

    def __init__(self, executor, forks_branches: bool, feature_layers: tuple[int, ...] | None = None) -> None:
        self._executor = executor
        self.forks_branches = forks_branches
        self.feature_layers = feature_layers

    def observe_batch(self, observed, features: torch.Tensor, logits: torch.Tensor) -> None:
        """Send each sequence's feature rows of the last forward (one gather for the batch; as
        numpy arrays, which cross a pipe or Ray's object store by value)."""
        if not self.feature_layers:
            return
        gathered = select_rows(features, observed_rows(observed)[0]).float().cpu().numpy()
        sent, offset = [], 0
        for seq, start, rows, _ in observed:
            sent.append((seq.seq_id, start, gathered[offset : offset + len(rows)]))
            offset += len(rows)
        self._tell("features", (sent,))

    def draft(self, step: DraftStep) -> list[DraftTree]:
        return draft_from_text(self, step)

    def propose(self, requests: Sequence[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        return self._executor.call("propose", (snapshots(requests), shape))

    def propose_branches(self, requests: Sequence[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        """Branches as serial calls (the executor's own ``start`` sends them as one command)."""
        return propose_slot_by_slot(self, requests, shape)

    def capture_missed_graphs(self) -> None:
        """Nothing here: the copy captures its own graphs."""

    def settled(self, seq: SequenceView, settled: Settled) -> None:
        self._tell("settled", (SeqSnapshot.of(seq), settled))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        self._tell("truncate", (seq_id, num_tokens))

    def release(self, seq_id: int) -> None:
        self._tell("release", (seq_id,))

    def finished(self, seq: SequenceView) -> None:
        self._tell("finished", (SeqSnapshot.of(seq),))

    def _tell(self, command: str, args: tuple) -> None:
        """A call nothing waits for: lost with a dead host, whose failure the next proposal reports."""
        try:
            self._executor.tell(command, args)
        except ExecutorError:
            logger.debug("draft host gone: %s not delivered", command)


def round_trip_s(executor: DraftExecutor, repeats: int = 200) -> float:
    """Median seconds of one empty command there and back over ``executor``'s channel."""
    import statistics
    import time

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        executor.call("ping", ())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class HostExecutor(DraftExecutor):
    """An executor whose drafter is a copy held by a host elsewhere (a process, an actor): the
    engine's calls go over ``call``/``tell``, and the source drafter's weight changes follow."""

    def __init__(self, source: Drafter | None) -> None:
        super().__init__(
            _RemoteDrafter(
                self,
                source.forks_branches if source is not None else False,
                source.feature_layers if source is not None else None,
            )
        )
        self._source = source  # the in-process drafter whose weight changes are sent on
        self._fingerprint = _fingerprint(source)

    @abstractmethod
    def call(self, command: str, args: tuple): ...

    @abstractmethod
    def tell(self, command: str, args: tuple) -> None: ...

    def refresh(self) -> None:
        """Send the source drafter's weights if they changed since the last time (a training step,
        ``load_state_dict``): the host drafts with the current weights."""
        fingerprint = _fingerprint(self._source)
        if fingerprint != self._fingerprint:
            self.tell("weights", (weights_bytes(_shipped_weights(self._source)),))
            self._fingerprint = fingerprint


class ActorExecutor(HostExecutor):
    """A host reached by actor calls (:mod:`tailspec.actors`): ``_send`` submits one command and
    returns its reference."""

    failure = "the draft actor failed"

    def __init__(self, actors: Actors, source: Drafter | None) -> None:
        super().__init__(source)
        self._actors = actors
        self._pending: list = []

    @abstractmethod
    def _send(self, command: str, args: tuple) -> Any: ...

    def call(self, command: str, args: tuple):
        try:
            return self._actors.get(self._send(command, args))
        except Exception as e:
            raise ExecutorError(f"{self.failure}: {e}") from e

    def tell(self, command: str, args: tuple) -> None:
        self._send(command, args)

    def start(self, requests: Sequence[DraftRequest], shape: DraftShape) -> None:
        self._pending.append(self._send("branches", (snapshots(requests), shape)))

    def finish(self) -> list[DraftTree]:
        pending, self._pending = self._pending, []
        try:
            return [tree for trees in self._actors.get(pending) for tree in trees]
        except Exception as e:
            raise ExecutorError(f"{self.failure}: {e}") from e


class RayExecutor(ActorExecutor):
    """A Ray actor running ``build()``'s drafter (on any node of the cluster with ``threads`` free
    CPUs, or ``num_gpus``): the same commands as the draft process, as actor calls (Ray keeps one
    caller's calls to an actor in order)."""

    name = "ray"

    def __init__(
        self,
        build: Callable[[], Drafter],
        threads: int = 1,
        source: Drafter | None = None,
        num_gpus: float = 0,
        start_timeout_s: float = 300.0,
        kernels: str = "auto",
    ) -> None:
        ray = ray_module()

        if not ray.is_initialized():
            raise ValueError("mirror executor 'ray' needs a running Ray (ray.init(...) or a cluster address)")
        super().__init__(RayActors(), source)
        self._actor = self._actors.spawn(
            DrafterHost, build, threads, kernels, num_cpus=threads, num_gpus=num_gpus, max_concurrency=1
        )
        try:
            self._actors.get(self._send("ping", ()), timeout=start_timeout_s)
        except Exception as e:
            self.close()
            raise ExecutorError(f"the draft actor did not start: {e}") from e

    def _send(self, command: str, args: tuple) -> Any:
        return self._actors.call(self._actor, "handle", command, args)

    def close(self) -> None:
        try:
            self._actors.kill(self._actor)
        except Exception:
            logger.debug("draft actor already gone")


def weights_bytes(model: torch.nn.Module) -> bytes:
    """A model's weights as bytes (what a draft host's ``load_weights`` takes)."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    return buffer.getvalue()


def _shipped_weights(drafter: Drafter | None) -> torch.nn.Module | None:
    """The module whose weights a copy of ``drafter`` elsewhere follows (an EAGLE-3 head with the
    target's embeddings, a drafter LM); None for a drafter no copy of which runs elsewhere."""
    return drafter.shipped_weights() if isinstance(drafter, Portable) else None


def _fingerprint(drafter: Drafter | None) -> int | None:
    model = _shipped_weights(drafter)
    if model is None:
        return None
    return hash(tuple((p.data_ptr(), p._version) for p in model.parameters()))
