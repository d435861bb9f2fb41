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

This module holds the contract and the executors of this process (``inline``, ``thread``,
``stream``, ``device``); a copy of the drafter elsewhere is ``hosted.py``'s (``ray``, the peer's
base) and ``process_executor.py``'s; ``slot.make_executor`` builds the one configured.
"""

from __future__ import annotations

import contextvars
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...draft_contract import (
    Drafter,
    DraftRequest,
    DraftShape,
    DraftTree,
)

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
