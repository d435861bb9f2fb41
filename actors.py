"""Where actors run: on a Ray cluster, or as threads of this process.

The rollout workers (``workers/``) and the draft hosts they lend each other are actors: objects
that live elsewhere and answer method calls with references to results. :class:`Actors` is the
little that code needs from an actor system: start an actor, call a method (or open a stream of
its results), put a value in the object store, wait for references, get them, kill an actor.
Two implementations:

``RayActors``     Ray actors on the cluster ``ray.init`` joined: one process each, placed by
                  their CPU and GPU demands. What a multi-GPU or multi-node rollout uses.
``ThreadActors``  every actor an object of this process whose calls run on its own thread pool.
                  No cluster and no process to start (an actor is ready in milliseconds rather
                  than the seconds a Ray worker takes to import torch and transformers); a
                  debugger stops in actor code. It keeps Ray's semantics where code could come to
                  rely on them: arguments, put values and results are copied (an actor never
                  shares an object with its caller), a reference passed as a top-level argument
                  arrives as its value, a killed actor's pending and later calls fail with
                  :class:`ActorDied`, and a call that raised fails with :class:`CallFailed`.
                  Resources are not placed: every actor shares this process's cores.

Errors are the same for both: :class:`ActorDied`, :class:`CallFailed`, :class:`WaitTimeout`.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .extras import need

BACKENDS = ("ray", "threads")


class ActorDied(RuntimeError):
    """The actor a call went to is gone (killed, crashed, or its node lost)."""


class CallFailed(RuntimeError):
    """The called method raised in the actor (the cause is chained)."""


class WaitTimeout(TimeoutError):
    """A result did not arrive within the time asked."""


class Actors(ABC):
    """An actor system (see the module docstring)."""

    name: str

    @abstractmethod
    def spawn(self, cls: type, *args: Any, num_cpus: float, num_gpus: float, max_concurrency: int) -> Any:
        """Start ``cls(*args)`` as an actor (without waiting for it) and return its handle. Its
        methods run on up to ``max_concurrency`` threads at once."""

    @abstractmethod
    def call(self, actor: Any, method: str, *args: Any) -> Any:
        """Call ``actor.method(*args)``; returns a reference to its result."""

    @abstractmethod
    def stream(self, actor: Any, method: str, *args: Any) -> Any:
        """Call a generator method: the returned stream can be waited on (ready when its next item
        is) and ``next(stream)`` gives a reference to that item (StopIteration at its end)."""

    @abstractmethod
    def put(self, value: Any) -> Any:
        """``value`` in the object store, as a reference (a snapshot: later changes stay out)."""

    @abstractmethod
    def get(self, refs: Any, timeout: float | None = None) -> Any:
        """The value of one reference, or the values of a list of them, waiting for them."""

    @abstractmethod
    def wait(self, refs: Sequence[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        """(ready, not ready): returns once ``num_returns`` of ``refs`` are ready or ``timeout`` passed."""

    @abstractmethod
    def kill(self, actor: Any) -> None:
        """End ``actor`` at once; its pending calls fail with :class:`ActorDied`."""

    def resources(self) -> str:
        """What the cluster has free of its total (for error messages)."""
        return "one process's cores"


def actors_for(backend: str) -> Actors:
    """The actor system named ``backend`` (one of :data:`BACKENDS`)."""
    if backend == "ray":
        return RayActors()
    if backend == "threads":
        return ThreadActors()
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


# -- Ray --------------------------------------------------------------------------------------
def ray_module():
    """Ray, or the one line saying to install ``tailspec[ray]``."""
    return need("ray", "ray", "tailspec's Ray actors (rollout workers, draft hosts)")


class RayActors(Actors):
    """Ray actors; Ray's errors are raised as this module's."""

    name = "ray"

    def spawn(self, cls: type, *args: Any, num_cpus: float, num_gpus: float, max_concurrency: int) -> Any:
        ray = ray_module()

        remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=max_concurrency)(cls)
        return remote.remote(*args)

    def call(self, actor: Any, method: str, *args: Any) -> Any:
        return getattr(actor, method).remote(*args)

    def stream(self, actor: Any, method: str, *args: Any) -> Any:
        return getattr(actor, method).options(num_returns="streaming").remote(*args)

    def put(self, value: Any) -> Any:
        ray = ray_module()

        return ray.put(value)

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        ray = ray_module()

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            raise ActorDied(str(e)) from e
        except ray.exceptions.GetTimeoutError as e:
            raise WaitTimeout(str(e)) from e
        except ray.exceptions.RayTaskError as e:
            raise CallFailed(str(e)) from e

    def wait(self, refs: Sequence[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        ray = ray_module()

        return ray.wait(list(refs), num_returns=num_returns, timeout=timeout)

    def kill(self, actor: Any) -> None:
        ray = ray_module()

        ray.kill(actor)

    def resources(self) -> str:
        ray = ray_module()

        def amounts(resources: dict[str, float]) -> str:
            return f"CPU {resources.get('CPU', 0):g}, GPU {resources.get('GPU', 0):g}"

        return f"{amounts(ray.available_resources())} free of {amounts(ray.cluster_resources())}"


# -- threads ----------------------------------------------------------------------------------
_changed = threading.Condition()  # notified whenever a reference or stream becomes ready


class _Ref:
    """A result to come: a value or an error."""

    def __init__(self) -> None:
        self._ready = False
        self._value: Any = None
        self._error: BaseException | None = None

    def __deepcopy__(self, memo: dict) -> _Ref:
        return self

    @property
    def ready(self) -> bool:
        return self._ready

    def _settle(self, value: Any = None, error: BaseException | None = None) -> None:
        with _changed:
            if not self._ready:  # the first outcome stays (a kill before the result, or after)
                self._value, self._error, self._ready = value, error, True
                _changed.notify_all()

    @classmethod
    def of(cls, value: Any = None, error: BaseException | None = None) -> _Ref:
        ref = cls()
        ref._settle(value, error)
        return ref

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class _Stream:
    """The items a generator method yields, as they come."""

    def __init__(self) -> None:
        self._items: deque[_Ref] = deque()
        self._ended = False

    def __deepcopy__(self, memo: dict) -> _Stream:
        return self

    @property
    def ready(self) -> bool:
        return bool(self._items) or self._ended

    def _push(self, ref: _Ref, *, last: bool = False) -> None:
        with _changed:
            if not self._ended:
                self._items.append(ref)
                self._ended = last
                _changed.notify_all()

    def _end(self) -> None:
        with _changed:
            self._ended = True
            _changed.notify_all()

    def __iter__(self) -> Iterator[_Ref]:
        return self

    def __next__(self) -> _Ref:
        with _changed:
            while not self.ready:
                _changed.wait()
            if self._items:
                return self._items.popleft()
            raise StopIteration


class ThreadActor:
    """An actor of :class:`ThreadActors`: the object, the daemon threads that run its calls (a
    user's run that ends without killing it does not wait for them), and whether it was killed."""

    _numbers = itertools.count()

    def __init__(self, cls: type, max_concurrency: int) -> None:
        self.name = f"{cls.__name__}-{next(self._numbers)}"
        self.instance: Any = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._work: queue.SimpleQueue[tuple[Callable[[], None], _Ref | _Stream] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{self.name}-{i}", daemon=True) for i in range(max_concurrency)
        ]
        self._open: set[_Ref | _Stream] = set()  # calls not answered yet
        self.dead = False

    def __deepcopy__(self, memo: dict) -> ThreadActor:
        return self  # a handle travels as itself

    def __repr__(self) -> str:
        return f"ThreadActor({self.name}{', dead' if self.dead else ''})"

    def start(self, build: Callable[[], Any]) -> None:
        """Build the instance on a thread of its own; calls wait for it."""

        def run() -> None:
            try:
                self.instance = build()
            except BaseException as e:  # reported by every call, as Ray reports a failed creation
                self._build_error = e
            finally:
                self._built.set()

        threading.Thread(target=run, name=f"{self.name}-build", daemon=True).start()
        for thread in self._threads:
            thread.start()

    def _died(self, why: str) -> ActorDied:
        return ActorDied(f"actor {self.name} died: {why}")

    def submit(self, work: Callable[[], None], answer: _Ref | _Stream) -> None:
        with _changed:
            if self.dead:
                _answer_error(answer, self._died("killed before the call"))
                return
            self._open.add(answer)
        self._work.put((work, answer))

    def _serve(self) -> None:
        self._built.wait()
        while (job := self._work.get()) is not None:
            work, answer = job
            try:
                if self._build_error is not None:
                    _answer_error(answer, self._died(f"its constructor raised {self._build_error!r}"))
                elif not self.dead:
                    work()
            finally:
                with _changed:
                    self._open.discard(answer)

    def kill(self, why: str = "killed") -> None:
        """Answer every open call with :class:`ActorDied`; calls running go on until they next
        yield or return (a thread cannot be stopped), and their results are dropped."""
        with _changed:
            self.dead = True
            open_calls, self._open = self._open, set()
        for answer in open_calls:
            _answer_error(answer, self._died(why))
        for _ in self._threads:
            self._work.put(None)


def _answer_error(answer: _Ref | _Stream, error: BaseException) -> None:
    if isinstance(answer, _Stream):
        answer._push(_Ref.of(error=error), last=True)
    else:
        answer._settle(error=error)


def _own_copy(value: Any) -> Any:
    """What crossing to or from an actor makes of ``value``: the actor's own copy of it."""
    return copy.deepcopy(value)


def _arguments(args: tuple) -> tuple:
    """Top-level references become their values (waited for), each the receiver's own copy."""
    return tuple(_own_copy(_get_one(a)) if isinstance(a, _Ref) else a for a in args)


def _get_one(ref: _Ref, timeout: float | None = None) -> Any:
    with _changed:
        if not _changed.wait_for(lambda: ref.ready, timeout=timeout):
            raise WaitTimeout(f"a result did not arrive within {timeout} s")
    return ref.result()


class ThreadActors(Actors):
    """Actors as objects of this process, each with its own thread pool (see the module docstring)."""

    name = "threads"

    def spawn(self, cls: type, *args: Any, num_cpus: float, num_gpus: float, max_concurrency: int) -> ThreadActor:
        actor = ThreadActor(cls, max_concurrency)
        args = _own_copy(args)
        actor.start(lambda: cls(*_arguments(args)))
        return actor

    def call(self, actor: ThreadActor, method: str, *args: Any) -> _Ref:
        ref = _Ref()
        args = _own_copy(args)

        def work() -> None:
            try:
                value = getattr(actor.instance, method)(*_arguments(args))
                ref._settle(_own_copy(value))
            except BaseException as e:
                ref._settle(error=_failed(actor, method, e))

        actor.submit(work, ref)
        return ref

    def stream(self, actor: ThreadActor, method: str, *args: Any) -> _Stream:
        stream = _Stream()
        args = _own_copy(args)

        def work() -> None:
            try:
                items = getattr(actor.instance, method)(*_arguments(args))
                for item in items:
                    if actor.dead:  # the kill answered the stream; the generator's cleanup runs
                        items.close()
                        return
                    stream._push(_Ref.of(_own_copy(item)))
            except BaseException as e:
                _answer_error(stream, _failed(actor, method, e))
                return
            stream._end()

        actor.submit(work, stream)
        return stream

    def put(self, value: Any) -> _Ref:
        return _Ref.of(_own_copy(value))

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        if not isinstance(refs, list):
            return _get_one(refs, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout  # one timeout for them all
        return [_get_one(r, None if deadline is None else max(deadline - time.monotonic(), 0.0)) for r in refs]

    def wait(self, refs: Sequence[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        refs = list(refs)
        with _changed:
            _changed.wait_for(lambda: sum(r.ready for r in refs) >= num_returns, timeout=timeout)
            ready = [r for r in refs if r.ready][:num_returns]
        return ready, [r for r in refs if not any(r is s for s in ready)]

    def kill(self, actor: ThreadActor) -> None:
        actor.kill()


def _failed(actor: ThreadActor, method: str, error: BaseException) -> BaseException:
    if actor.dead:
        return actor._died("killed during the call")
    failure = CallFailed(f"{actor.name}.{method} raised {error!r}")
    failure.__cause__ = error
    return failure
