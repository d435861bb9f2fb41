"""Requests that move while they run: the state a request carries from one engine to another, and
the inbox through which a running engine is handed new work and asked to give work back.

A moved request continues exactly where it stopped: the receiving engine recomputes the K/V of
its prompt and generated tokens (as after a preemption), then samples the next token from the
same distribution, drawing from the request's own generator state when it has a seed. Only
tokens, log-probabilities and a small generator state travel, never K/V.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from .params import SamplingParams


@dataclass
class PartialRequest:
    """A request stopped mid-way on one engine, to be continued on another."""

    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int]
    logprobs: list[float]
    prompt_logprobs: list[float] | None = None
    generator_state: torch.Tensor | None = None  # the request's own RNG (seeded requests only)
    num_preemptions: int = 0
    num_spec_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)


@dataclass
class InboxItem:
    """One request for a serving engine; ``key`` is the caller's name for it (a rollout index)."""

    key: int
    prompt_ids: list[int]
    params: SamplingParams
    resume: PartialRequest | None = None
    expected_length: float | None = None  # predicted completion length (the length-aware draft budget)


@dataclass
class InboxTake:
    """What :meth:`RequestInbox.take` hands the engine: new items, keys to give back, whether the
    session may end once it holds nothing (closed and every promised item taken)."""

    items: list[InboxItem] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    released_waiting: list[InboxItem] = field(default_factory=list)  # given back before they started
    may_end: bool = False


class RequestInbox:
    """Thread-safe hand-over between a caller and an engine serving in another thread.

    ``close(total)`` says how many items the session gets in all: calls may arrive out of order
    (a threaded Ray actor runs them on several threads), so the session ends only when it is closed
    *and* has taken ``total`` items *and* holds nothing. A release naming an item still in the inbox
    gives it back untouched; one naming a key the engine does not hold is ignored (the caller learns
    what was released from the answer, never assumes it).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[InboxItem] = []
        self._release: list[int] = []
        self._taken = 0
        self._total: int | None = None

    def put(self, items: Seq[InboxItem]) -> None:
        with self._cond:
            self._items.extend(items)
            self._cond.notify_all()

    def release(self, keys: Seq[int]) -> None:
        with self._cond:
            self._release.extend(keys)
            self._cond.notify_all()

    def close(self, total: int) -> None:
        with self._cond:
            self._total = total
            self._cond.notify_all()

    def has_news(self) -> bool:
        """Items or releases wait to be taken (a close alone is news only to an idle engine)."""
        with self._cond:
            return bool(self._items or self._release)

    def take(self) -> InboxTake:
        with self._cond:
            wanted = set(self._release)
            waiting = [i for i in self._items if i.key in wanted]
            items = [i for i in self._items if i.key not in wanted]
            given = {i.key for i in waiting}
            take = InboxTake(items, [k for k in self._release if k not in given], waiting)
            self._taken += len(items) + len(waiting)
            self._items, self._release = [], []
            take.may_end = self._total is not None and self._taken >= self._total
            return take

    def wait(self, timeout: float | None = None) -> None:
        """Block until something arrives (or ``timeout`` seconds pass)."""
        with self._cond:
            if not (self._items or self._release) and not self._closed_and_complete():
                self._cond.wait(timeout)

    def _closed_and_complete(self) -> bool:
        return self._total is not None and self._taken >= self._total


@dataclass
class ServeUpdate:
    """One step's news from :meth:`tailspec.rollout.RolloutEngine.serve`: requests that finished
    (``(key, output)``) and requests given back (``(key, partial)``, ``partial`` None for one that
    had not started)."""

    finished: list = field(default_factory=list)
    released: list[tuple[int, PartialRequest | None]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finished or self.released)
