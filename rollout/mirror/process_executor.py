"""The ``process`` draft executor: a child process holding its own copy of the drafter (weights
sent as bytes, again whenever they change), with its own torch threads: on CPU the draft really
runs on a spare core. The child is started from a forkserver that imported the engine once."""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ...draft_contract import Drafter, DraftRequest, DraftShape, DraftTree
from .executors import ExecutorError
from .hosted import ANSWERED, DrafterHost, HostExecutor, snapshots


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
            if command in ANSWERED:
                conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class ProcessExecutor(HostExecutor):
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
        self.send("branches", (snapshots(requests), shape))
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
