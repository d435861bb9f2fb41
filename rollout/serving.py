"""The engine's front ends: a batch of prompts (:func:`generate`, :func:`generate_stream`) and an
inbox served as requests arrive (:func:`serve`, what a Ray worker runs). Each drives
:meth:`RolloutEngine.step` and hands requests over the moment they finish; what is left when the
caller stops is aborted and dropped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..progress import progress_bar
from .admission import RequestLimits, prepare_requests
from .handoff import InboxItem, PartialRequest, RequestInbox, ServeUpdate
from .params import SamplingParams
from .request import RequestOutput
from .stats import EngineStats


class SteppedEngine(Protocol):
    """What the front ends drive: :class:`tailspec.rollout.RolloutEngine`'s step-wise API."""

    limits: RequestLimits
    config: Any  # its RolloutConfig (``progress``)
    stats: EngineStats

    def add_request(self, prompt_ids: Seq[int], params: SamplingParams | None = None, **options: Any) -> int: ...

    def new_group(self) -> int: ...

    def step(self) -> list[int]: ...

    def has_unfinished(self) -> bool: ...

    def pop_output(self, request_id: int) -> RequestOutput: ...

    def release(self, request_id: int) -> PartialRequest | None: ...

    def discard(self, request_id: int) -> None: ...

    def inference(self) -> AbstractContextManager[None]: ...


def generate(
    engine: SteppedEngine,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
) -> list[RequestOutput]:
    """One completion per prompt, in order. Identical prompts are prefilled once and forked.

    Every request is validated before any is submitted: one bad request raises ``ValueError``
    (naming its index) and nothing of the call runs."""
    outputs: list[RequestOutput | None] = [None] * len(prompts)
    for finished in generate_stream(engine, prompts, params, progress=progress):
        for index, output in finished:
            outputs[index] = output
    return outputs  # type: ignore[return-value]


def generate_stream(
    engine: SteppedEngine,
    prompts: Seq[Seq[int]],
    params: SamplingParams | Seq[SamplingParams] | None = None,
    *,
    progress: bool | None = None,
) -> Iterator[list[tuple[int, RequestOutput]]]:
    """:func:`generate` that hands over each step's finished requests as ``(prompt index, output)``
    pairs the moment they finish (a Ray worker streams them on, so a worker that dies loses only
    what had not finished). Requests are validated and submitted by this call; those left when the
    caller stops iterating are aborted."""
    prompts, per_request = prepare_requests(prompts, params, engine.limits)
    index_of: dict[int, int] = {}  # request id -> prompt index
    _admit(engine, [InboxItem(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, per_request))], index_of)
    return _stream_finished(engine, index_of, engine.config.progress if progress is None else progress)


def _stream_finished(
    engine: SteppedEngine, index_of: dict[int, int], show: bool
) -> Iterator[list[tuple[int, RequestOutput]]]:
    bar = progress_bar(total=len(index_of), desc="rollout", unit="seq", disable=not show, leave=False)
    start = time.perf_counter()
    try:
        while index_of:
            done: list[int] = []
            with engine.inference():  # left while suspended: the caller may use the model meanwhile
                while not done:
                    if not engine.has_unfinished():
                        raise RuntimeError("engine idle with unfinished requests (scheduler bug)")
                    done = [r for r in engine.step() if r in index_of]
            bar.update(len(done))
            yield [(index_of.pop(r), engine.pop_output(r)) for r in done]
    finally:
        for request_id in index_of:
            engine.discard(request_id)
        bar.close()
        engine.stats.wall_time_s += time.perf_counter() - start


def serve(engine: SteppedEngine, inbox: RequestInbox, *, idle_wait_s: float = 0.5) -> Iterator[ServeUpdate]:
    """Serve what arrives in ``inbox`` until it is closed and everything taken has finished or been
    given back: requests join the running batch at the next step (continuous batching across
    submissions); a step's finished and released requests are yielded together, under their inbox
    keys. Fresh requests taken together with the same prompt are prefilled once."""
    key_of: dict[int, int] = {}  # request id -> inbox key
    start = time.perf_counter()
    try:
        while True:
            take = inbox.take()
            update = ServeUpdate(released=[(item.key, item.resume) for item in take.released_waiting])
            _admit(engine, take.items, key_of)
            held = {key: rid for rid, key in key_of.items()}
            for key in take.release:
                partial = engine.release(held[key]) if key in held else None
                if partial is not None:  # None: it finished, and a step reports it
                    update.released.append((key, partial))
                    del key_of[held[key]]
            if key_of and not update.released:
                with engine.inference():
                    while not update.finished and not inbox.has_news():
                        update.finished = [(key_of.pop(r), engine.pop_output(r)) for r in engine.step() if r in key_of]
            if update:
                yield update
            elif not key_of:
                if take.may_end:
                    return
                inbox.wait(idle_wait_s)
    finally:
        for request_id in key_of:
            engine.discard(request_id)
        engine.stats.wall_time_s += time.perf_counter() - start


def _admit(engine: SteppedEngine, items: list[InboxItem], key_of: dict[int, int]) -> None:
    """Add ``items`` (recording request id -> item key); fresh requests of one prompt form a group."""
    counts: dict[tuple[int, ...], int] = {}
    for item in items:
        if item.resume is None:
            counts[tuple(item.prompt_ids)] = counts.get(tuple(item.prompt_ids), 0) + 1
    groups: dict[tuple[int, ...], int] = {}
    for item in items:
        key = tuple(item.prompt_ids)
        group = groups.setdefault(key, engine.new_group()) if counts.get(key, 0) > 1 and item.resume is None else None
        rid = engine.add_request(
            item.prompt_ids, item.params, group=group, resume=item.resume, expected_length=item.expected_length
        )
        key_of[rid] = item.key
