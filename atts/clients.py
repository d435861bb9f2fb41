"""Engine clients: the one interface the ATTS loops use to reach a draft or target engine.

``submit`` queues a request and returns at once; ``poll`` returns whatever has finished. The
in-process client advances its engine by one step per ``poll`` (continuous batching admits every
request submitted since the last step); the Ray client talks to an :class:`EngineActor` whose own
thread steps the engine continuously, so the draft and target engines run at the same time.
Requests are validated in the caller's process first, so a bad request raises ``ValueError`` there.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..actors import ray_module
from ..rollout.engine import RequestLimits, RolloutEngine
from ..rollout.params import RolloutConfig, SamplingParams
from ..rollout.request import RequestOutput

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    name: str
    eos_token_ids: frozenset[int]
    vocab_size: int
    limits: RequestLimits

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> int: ...

    def poll(self) -> list[tuple[int, RequestOutput]]: ...

    def num_pending(self) -> int: ...

    def session(self) -> contextlib.AbstractContextManager: ...


class LocalEngineClient:
    """An in-process :class:`RolloutEngine`; each ``poll`` runs one engine step."""

    def __init__(self, engine: RolloutEngine, name: str = "engine") -> None:
        self.engine = engine
        self.name = name
        self.eos_token_ids = engine.eos_ids
        self.vocab_size = engine.vocab_size
        self.limits = engine.limits
        self._pending: set[int] = set()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        ticket = self.engine.add_request(list(prompt_ids), params)  # validates
        self._pending.add(ticket)
        return ticket

    def poll(self) -> list[tuple[int, RequestOutput]]:
        if not self._pending:
            return []
        with self.engine.inference():  # re-entrant: free inside session()
            finished = [i for i in self.engine.step() if i in self._pending]
        self._pending.difference_update(finished)
        return [(i, self.engine.pop_output(i)) for i in finished]

    def num_pending(self) -> int:
        return len(self._pending)

    def session(self) -> contextlib.AbstractContextManager:
        """Keep the engine's inference mode on across many polls (cheaper than per step)."""
        return self.engine.inference()

    @property
    def stats(self) -> dict[str, float]:
        return self.engine.stats.as_dict()


class EngineActor:
    """Ray actor body: an engine stepped by its own thread; requests in, finished outputs out."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: RolloutConfig,
        eos_token_ids: list[int] | None = None,
        num_threads: int | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        if torch.cuda.is_available():
            model = model.to("cuda")
        self.engine = RolloutEngine(model.eval(), config, eos_token_ids=eos_token_ids)
        self._inbox: queue.Queue[tuple[int, list[int], SamplingParams]] = queue.Queue()
        self._outbox: queue.Queue[tuple[int, RequestOutput]] = queue.Queue()
        self._tickets: dict[int, int] = {}  # engine request id -> caller's ticket
        self._error: BaseException | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"eos_token_ids": sorted(e.eos_ids), "vocab_size": e.vocab_size, "limits": e.limits}

    def submit(self, ticket: int, prompt_ids: list[int], params: SamplingParams) -> None:
        self._inbox.put((ticket, prompt_ids, params))

    def poll(self, timeout_s: float) -> list[tuple[int, RequestOutput]]:
        """Finished outputs; waits up to ``timeout_s`` for the first one."""
        if self._error is not None:
            raise RuntimeError("the engine loop failed") from self._error
        out = []
        try:
            out.append(self._outbox.get(timeout=timeout_s))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def stats(self) -> dict[str, float]:
        return self.engine.stats.as_dict()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        engine = self.engine
        try:
            with engine.inference():
                while not self._closed.is_set():
                    idle = not engine.has_unfinished()
                    try:
                        while True:
                            item = self._inbox.get(timeout=0.01) if idle else self._inbox.get_nowait()
                            idle = False
                            ticket, prompt_ids, params = item
                            self._tickets[engine.add_request(prompt_ids, params)] = ticket
                    except queue.Empty:
                        pass
                    if not engine.has_unfinished():
                        continue
                    for request_id in engine.step():
                        self._outbox.put((self._tickets.pop(request_id), engine.pop_output(request_id)))
        except BaseException as e:  # surfaced to the caller by the next poll
            logger.exception("engine loop failed")
            self._error = e


class RayEngineClient:
    """An engine in a Ray actor (one per GPU on a cluster; on CPU, pin its threads).

    The client keeps every in-flight request (prompt and parameters), so when the actor dies
    (node lost, OOM, killed) it starts a new one and submits them again, up to ``max_restarts``
    times; requests carry their own seeds, so their results do not change.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: RolloutConfig,
        *,
        name: str = "engine",
        eos_token_ids: Sequence[int] | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        num_threads: int | None = None,
        poll_timeout_s: float = 0.002,
        max_restarts: int = 3,
    ) -> None:
        ray = ray_module()

        self.name = name
        self.poll_timeout_s = poll_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self._actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4)(EngineActor)
        self._actor_args = (
            ray.put(model),
            config,
            list(eos_token_ids) if eos_token_ids is not None else None,
            num_threads,
        )
        self._start_actor()
        info = ray.get(self.actor.describe.remote())
        self.eos_token_ids = frozenset(info["eos_token_ids"])
        self.vocab_size = int(info["vocab_size"])
        self.limits: RequestLimits = info["limits"]
        self._next_ticket = 0
        self._pending: dict[int, tuple[list[int], SamplingParams]] = {}

    def _start_actor(self) -> None:
        self.actor = self._actor_cls.remote(*self._actor_args)

    def _restart(self, error: Exception) -> None:
        ray = ray_module()

        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"{self.name}: engine actor died {self.restarts + 1} times; giving up") from error
        self.restarts += 1
        logger.warning(
            "%s: engine actor died (%s); starting a new one and resubmitting %d request(s)",
            self.name,
            type(error).__name__,
            len(self._pending),
        )
        try:
            ray.kill(self.actor)
        except Exception:  # already gone
            pass
        self._start_actor()
        for ticket, (prompt, params) in self._pending.items():
            self.actor.submit.remote(ticket, prompt, params)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        prompt = list(prompt_ids)
        self.limits.check(prompt, params)
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self._pending[ticket] = (prompt, params)
        self.actor.submit.remote(ticket, prompt, params)
        return ticket

    def poll(self) -> list[tuple[int, RequestOutput]]:
        ray = ray_module()

        if not self._pending:
            return []
        try:
            out = ray.get(self.actor.poll.remote(self.poll_timeout_s))
        except ray.exceptions.RayActorError as e:
            self._restart(e)
            return []
        for ticket, _ in out:
            self._pending.pop(ticket, None)
        return out

    def num_pending(self) -> int:
        return len(self._pending)

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def stats(self) -> dict[str, float]:
        ray = ray_module()

        return ray.get(self.actor.stats.remote())

    def close(self) -> None:
        ray = ray_module()

        try:
            ray.get(self.actor.close.remote())
        except ray.exceptions.RayActorError:
            pass
        finally:
            ray.kill(self.actor)


def as_client(engine: RolloutEngine | EngineClient, name: str) -> EngineClient:
    return LocalEngineClient(engine, name) if isinstance(engine, RolloutEngine) else engine


def wait_all(client: EngineClient, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
    """Submit ``requests`` and wait for every one (a barrier); outputs in request order."""
    tickets = [client.submit(p, sp) for p, sp in requests]
    results: dict[int, RequestOutput] = {}
    while len(results) < len(tickets):
        got = client.poll()
        if not got and client.num_pending() == 0:
            raise RuntimeError(f"{client.name}: requests vanished")
        results.update(got)
    return [results[t] for t in tickets]
