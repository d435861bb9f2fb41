"""Where a model drafter runs when it drafts beside the target (Mirror-SD, ``rollout/mirror/pipeline.py``).

An executor offers the drafter for the engine's ordinary synchronous calls (``drafter``), and
``start`` / ``finish`` to draft a set of branches while the caller goes on with the target's
forward. Only tokens, sampling parameters and the drafted trees cross; never KV.

===========  =================================================================================
``inline``   no overlap: ``start`` drafts at once on the caller's thread (the reference, and the
             cost of a mirror step with no spare compute)
``thread``   a worker thread of this process (CPU: contends with the target for the GIL, so it
             pays only where the forwards are long next to Python's share of them)
``stream``   a worker thread issuing the drafter's kernels on a second CUDA stream of the
             target's GPU
``device``   a worker thread driving a drafter that lives on another device (e.g. the GPU of a
             Ray worker that has finished its rollout), on that device's own stream
``process``  a child process with its own torch threads, holding its own copy of the drafter
             (weights sent as bytes, again whenever they change): on CPU the draft really runs
             on a spare core
``ray``      a Ray actor anywhere on the cluster holding its own copy of the drafter: another
             machine's idle CPU or GPU (round trips cost more: ``round_trip_s``)
(peer)       ``workers.draft_hosts.PeerExecutor``, not chosen by config: a draft host inside
             another rollout worker that has finished its work (the coordinator pairs them)
===========  =================================================================================
"""

from __future__ import annotations

import contextvars
import io
import logging
import queue
import sys
import threading
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...actors import Actors, RayActors
from ...draft_contract import (
    BranchView,
    Drafter,
    DraftRequest,
    DraftShape,
    DraftTree,
    Portable,
    SequenceView,
    observed_rows,
)
from ...kernels.dispatch import kernel_backend
from ...kernels.transfers import select_rows
from ..params import EXECUTORS

logger = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """The draft executor failed (its process died, or drafting raised); the engine drafts serially."""


class DraftExecutor(ABC):
    name: str = "executor"
    overlaps: bool = True  # whether branch drafting runs beside the caller

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    @abstractmethod
    def start(self, requests: Sequence[DraftRequest], shape: DraftShape) -> None:
        """Begin drafting ``requests`` (branch views) with ``shape``, after what earlier calls
        started; returns at once when it overlaps."""

    @abstractmethod
    def finish(self) -> list[DraftTree]:
        """The drafts of every :meth:`start` since the last finish, in order (waits for them)."""

    def refresh(self) -> None:  # noqa: B027 - optional hook
        """Bring the drafter's weights up to date (only an executor holding a copy has work here)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop any worker thread or process."""


class InlineExecutor(DraftExecutor):
    name = "inline"
    overlaps = False

    def __init__(self, drafter: Drafter) -> None:
        super().__init__(drafter)
        self._result: list[DraftTree] = []

    def start(self, requests: Sequence[DraftRequest], shape: DraftShape) -> None:
        self._result += self.drafter.propose_branches(requests, shape)

    def finish(self) -> list[DraftTree]:
        out, self._result = self._result, []
        return out


class ThreadExecutor(DraftExecutor):
    """A worker thread; with ``device`` a CUDA device, its work goes on a side stream of that
    device, ordered after the caller's stream at ``start`` and before it at ``finish``. Each
    draft runs in a copy of the caller's context variables at ``start``: the engine's kernel
    backend (``RolloutConfig.kernels``) holds in the thread as in the caller."""

    def __init__(self, drafter: Drafter, device: torch.device | None = None, name: str = "thread") -> None:
        super().__init__(drafter)
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tailspec-draft-{name}")
        self._futures: list[Future] = []
        cuda = device is not None and device.type == "cuda"
        self._device = device if cuda else None
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._done = None

    def start(self, requests: Sequence[DraftRequest], shape: DraftShape) -> None:
        context = contextvars.copy_context()
        if self._stream is None:
            self._futures.append(self._pool.submit(context.run, self.drafter.propose_branches, list(requests), shape))
            return
        ready = torch.cuda.current_stream().record_event()

        def run() -> list[DraftTree]:
            with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                trees = self.drafter.propose_branches(list(requests), shape)
                self._done = self._stream.record_event()
            return trees

        self._futures.append(self._pool.submit(context.run, run))

    def finish(self) -> list[DraftTree]:
        futures, self._futures = self._futures, []
        trees: list[DraftTree] = []
        for future in futures:
            try:
                trees += future.result()
            except Exception as e:
                raise ExecutorError(f"drafting on the {self.name} executor failed: {e}") from e
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
            self._done = None
        return trees

    def close(self) -> None:
        self._pool.shutdown(wait=True)


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


def _snapshots(requests: Sequence[DraftRequest]) -> list[tuple[SequenceView, int]]:
    return [(_snapshot(r.seq), r.max_depth) for r in requests]


_ANSWERED = ("propose", "branches", "ping")


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
        elif command in ("accepted", "truncate", "release", "finished"):
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


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a child is spawned, ``__main__`` names no file or module, so the child does not import
    the user's script: a script without an ``if __name__ == "__main__":`` guard would otherwise run
    its whole top level (its training) again in the draft process, and the parent would wait for
    that child forever. Everything the child runs is tailspec's (``_serve`` and the drafter's
    picklable builder); a builder defined in the user's script fails there with its traceback."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _draft_process_context():
    """How draft processes start: forked from a server process that imported this module (torch,
    transformers and tailspec's engine) once, where the platform has one (``forkserver``), so a
    draft process starts in well under a second rather than re-importing for seconds; else spawned.
    The server imports nothing of the user's script and initialises no GPU (each child does its
    own), and it serves every draft process of this program. A program that already started a
    forkserver with preloads of its own keeps them (the server reads its preloads once)."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _serve(build: Callable[[], Drafter], threads: int, kernels: str, conn) -> None:
    """The child's loop: build the drafter, then answer the parent's commands in order.

    A reader thread takes every command off the pipe as it comes. Otherwise a large answer and a
    large command could deadlock: the child blocked sending drafts the parent has not asked for
    yet, the parent blocked sending the next branches while the child does not read (two branch
    calls are in flight on a mirror step; each is large at large batch)."""
    try:
        host = DrafterHost(build, threads, kernels)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                inbox.put(None)
                return
            inbox.put(message)
            if message[0] == "close":
                return

    threading.Thread(target=read, daemon=True, name="tailspec-draft-inbox").start()
    while (message := inbox.get()) is not None and message[0] != "close":
        command, args = message
        try:
            result = host.handle(command, args)
            if command in _ANSWERED:
                conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class _RemoteDrafter(Drafter):
    """The engine's handle on a drafter across a boundary (``executor.call`` waits for the
    answer, ``executor.tell`` sends in order and does not wait)."""

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

    def propose(self, requests: Sequence[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        return self._executor.call("propose", (_snapshots(requests), shape))

    def accepted(self, seq: SequenceView, num_accepted: int) -> None:
        self._tell("accepted", (SeqSnapshot.of(seq), num_accepted))

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


class _HostExecutor(DraftExecutor):
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


class ProcessExecutor(_HostExecutor):
    """A child process (see :func:`_draft_process_context`) running ``build()``'s drafter with
    ``threads`` torch threads, under the ``kernels`` backend."""

    name = "process"

    def __init__(
        self,
        build: Callable[[], Drafter],
        threads: int = 1,
        source: Drafter | None = None,
        start_timeout_s: float = 300.0,
        kernels: str = "auto",
    ) -> None:
        super().__init__(source)
        ctx = _draft_process_context()
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(build, threads, kernels, child), daemon=True, name="tailspec-draft"
        )
        with _main_module_hidden():
            self._process.start()
        child.close()
        self._pending = 0  # branch calls sent and not yet answered
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise ExecutorError(f"the draft process did not start within {start_timeout_s:.0f} s")
        self.receive()

    def call(self, command: str, args: tuple):
        self.send(command, args)
        return self.receive()

    def tell(self, command: str, args: tuple) -> None:
        self.send(command, args)

    def send(self, command: str, args: tuple) -> None:
        if self._pending and command != "branches":
            raise RuntimeError(f"draft executor: {command!r} while branches are being drafted (call finish first)")
        try:
            self._conn.send((command, args))
        except (BrokenPipeError, OSError) as e:
            raise ExecutorError(f"the draft process is gone ({e})") from e

    def receive(self):
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            self._process.join(timeout=5)  # its pipe closes a moment before its exit is reaped
            raise ExecutorError(f"the draft process died (exit code {self._process.exitcode})") from e
        if status == "error":
            raise ExecutorError(f"the draft process failed:\n{payload}")
        return payload

    def start(self, requests: Sequence[DraftRequest], shape: DraftShape) -> None:
        self.send("branches", (_snapshots(requests), shape))
        self._pending += 1

    def finish(self) -> list[DraftTree]:
        trees: list[DraftTree] = []
        while self._pending:
            self._pending -= 1
            trees += self.receive()
        return trees

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
        self._conn.close()


class ActorExecutor(_HostExecutor):
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
        self._pending.append(self._send("branches", (_snapshots(requests), shape)))

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
        import ray

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


def make_executor(
    kind: str,
    drafter: Drafter,
    rebuild: Callable[[], Callable[[], Drafter]] | None,
    target_device: torch.device,
    draft_device: torch.device | None,
    threads: int,
    kernels: str = "auto",
) -> DraftExecutor:
    """The executor ``kind`` names (``auto``: ``stream`` or ``device`` on CUDA, ``process`` on CPU
    where the drafter can be rebuilt in a child, else ``thread``); a process or an actor drafts
    under the ``kernels`` backend (a thread inherits the caller's)."""
    if kind not in EXECUTORS:
        raise ValueError(f"mirror executor must be one of {EXECUTORS}, got {kind!r}")
    elsewhere = draft_device is not None and draft_device != target_device
    if kind == "auto":
        if target_device.type == "cuda":
            kind = "device" if elsewhere else "stream"
        else:
            kind = "process" if rebuild is not None else "thread"
    if kind == "inline":
        return InlineExecutor(drafter)
    if kind == "thread":
        return ThreadExecutor(drafter)
    if kind == "stream":
        if target_device.type != "cuda":
            raise ValueError("mirror executor 'stream' needs the target on a CUDA device")
        return ThreadExecutor(drafter, target_device, name="stream")
    if kind == "device":
        if not elsewhere:
            raise ValueError(
                f"mirror executor 'device' needs the drafter on another device than the target's {target_device}"
            )
        return ThreadExecutor(drafter, draft_device, name="device")
    if rebuild is None:
        raise ValueError(
            f"mirror executor {kind!r} cannot run the {drafter.name} drafter in another process "
            "(it has no rebuild(): it drafts with this process's target); use 'thread' or 'inline'"
        )
    if kind == "ray":
        return RayExecutor(rebuild(), threads, source=drafter, kernels=kernels)
    return ProcessExecutor(rebuild(), threads, source=drafter, kernels=kernels)
