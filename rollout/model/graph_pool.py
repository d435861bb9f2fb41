"""A memory-budgeted pool of captured forward passes, keyed by padded shape buckets.

A forward of ``num_seqs`` sequences with ``tokens`` new tokens each over contexts of up to
``context`` tokens is padded up to a :class:`GraphKey` bucket. The first time a bucket is seen,
the backend *captures* it: on CUDA a ``torch.cuda.CUDAGraph`` recorded into one memory pool
shared by every graph, with static input buffers that later calls copy into (no CPU
synchronisation inside the captured region); on CPU the eager backend keeps the same
bookkeeping around a plain call, so the pool logic is the same code everywhere and testable
without a GPU. Entries are kept in LRU order; when the bytes held exceed ``memory_budget``,
the least recently used entries are evicted. Counters: captures, hits, evictions, bytes.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ...kernels.transfers import to_device
from .staged_inputs import StagedInputs

logger = logging.getLogger(__name__)

Inputs = dict[str, torch.Tensor]
Outputs = torch.Tensor | tuple[torch.Tensor, ...]  # the logits, or the logits and tapped features
ForwardFn = Callable[[Inputs], Outputs]


def tensor_bytes(tensors: Outputs | Inputs) -> int:
    """Bytes of a forward's inputs or outputs: a dict, a tuple or one tensor."""
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in values)


@dataclass(frozen=True, order=True)
class GraphKey:
    batch: int  # padded number of sequences
    tokens: int  # padded new tokens per sequence
    context: int  # padded context length (keys attended to)
    taps: tuple[int, ...] = ()  # decoder layers whose input hidden states the forward also returns


@dataclass
class PoolStats:
    captures: int = 0
    hits: int = 0
    evictions: int = 0
    uncaptured: int = 0  # calls larger than the largest bucket (or off the owner thread), run without a graph
    bytes: int = 0
    capture_s: dict[GraphKey, float] = field(default_factory=dict)  # seconds each capture took (the last)


_capture_clock = [0.0]  # seconds every pool of this process spent capturing
_uncaptured_count = [0]  # forwards every pool of this process ran without a graph
_capture_lock = threading.Lock()


def capture_seconds() -> float:
    """Seconds all graph pools of this process have spent capturing so far. A step that captured
    ran once at the capture's cost; the adaptive selector times steps without it, since replays
    of the shape cost none of it (a 1B policy's capture takes as long as 10-20 of its steps)."""
    return _capture_clock[0]


InputSignature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def input_signature(inputs: Inputs) -> InputSignature:
    """A forward's inputs as a captured graph sees them: names, shapes and dtypes."""
    return tuple(sorted((name, tuple(t.shape), t.dtype) for name, t in inputs.items()))


def uncaptured_runs() -> int:
    """Forwards all graph pools of this process have run without a graph so far: shapes past the
    largest bucket, and shapes a draft executor's thread met that the owner had not captured (a
    draft thread's eager forwards launch every kernel under the GIL, beside the target's step)."""
    return _uncaptured_count[0]


def _round_up(value: int, buckets: tuple[int, ...]) -> int | None:
    i = bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


class CapturedForward:
    """What a backend returns: ``run(inputs)`` replays the captured forward on new inputs;
    ``replay()`` runs it again on the inputs it last ran, staging nothing (a step's device work
    without the engine around it, as the GPU speed stage measures it)."""

    nbytes: int = 0

    def run(self, inputs: Inputs) -> Outputs:  # pragma: no cover - interface
        raise NotImplementedError

    def replay(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _EagerForward(CapturedForward):
    def __init__(self, fn: ForwardFn, example: Inputs, device: torch.device) -> None:
        self.fn = fn
        # the static buffers a captured graph reads, filled the same way (the same code on CPU)
        self.staged = StagedInputs(example, device)
        self.nbytes = self.staged.nbytes

    def run(self, inputs: Inputs) -> Outputs:
        self.staged.load(inputs)
        return self.fn(self.staged.views)

    def replay(self) -> None:
        self.fn(self.staged.views)


class EagerBackend:
    """CPU (and fallback) backend: no capture, same interface, staging and accounting."""

    name = "eager"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def capture(self, fn: ForwardFn, example: Inputs) -> CapturedForward:
        return _EagerForward(fn, example, self.device)


class _CudaGraphForward(CapturedForward):
    def __init__(self, fn: ForwardFn, example: Inputs, pool, device: torch.device, warmup_iters: int = 2) -> None:
        self.staged = StagedInputs(example, device)  # static inputs, one host-to-device copy per dtype
        self.static_inputs = self.staged.views
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(warmup_iters):
                fn(self.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        before = torch.cuda.memory_reserved()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a draft executor's thread may capture while the caller's thread allocates
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.static_output = fn(self.static_inputs)
        # the capture's cost is counted whole (GraphPool times it); a stream sync, not the device's:
        # another thread's capture may be under way, and a device-wide sync would invalidate it
        torch.cuda.current_stream().synchronize()
        grown = torch.cuda.memory_reserved() - before
        buffers, output = tensor_bytes(self.static_inputs), tensor_bytes(self.static_output)
        # the output stays live between replays, so at least it is this graph's own; the pool's
        # intermediates are shared by all its graphs and show only as the pool's growth
        self.nbytes = buffers + max(grown, output)

    def run(self, inputs: Inputs) -> Outputs:
        self.staged.load(inputs)
        self.graph.replay()
        return self.static_output  # valid until the next replay of any graph in the pool

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """Captures into one memory pool shared by all graphs (``torch.cuda.graph_pool_handle``).

    The allocator frees a graph pool once no graph uses it, and a later capture into that freed
    pool fails inside PyTorch (an internal assert), so when every graph of the pool has been
    released (evicted, or too large to keep), the next capture starts a new pool.
    """

    name = "cuda_graph"

    def __init__(self, device: torch.device | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the CUDA graph backend needs a CUDA device; use the eager backend on CPU")
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.pool = torch.cuda.graph_pool_handle()
        self._live: weakref.WeakSet[_CudaGraphForward] = weakref.WeakSet()
        self._captured = False

    def capture(self, fn: ForwardFn, example: Inputs) -> CapturedForward:
        if self._captured and not self._live:
            self.pool = torch.cuda.graph_pool_handle()
        entry = _CudaGraphForward(fn, example, self.pool, self.device)
        self._live.add(entry)
        self._captured = True
        return entry


class GraphPool:
    """Captured forwards per bucket under a memory budget, least recently used evicted first."""

    def __init__(
        self,
        backend: EagerBackend | CudaGraphBackend | None = None,
        *,
        batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
        token_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
        context_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
        table_context_buckets: tuple[int, ...] = (2048, 8192, 32768),
        memory_budget: int = 1 << 30,
    ) -> None:
        named = (
            ("batch", batch_buckets),
            ("token", token_buckets),
            ("context", context_buckets),
            ("table_context", table_context_buckets),
        )
        for name, buckets in named:
            if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ValueError(f"{name}_buckets must be increasing ints >= 1, got {list(buckets)}")
        if not (isinstance(memory_budget, int) and memory_budget > 0):
            raise ValueError(f"memory_budget must be an int > 0 (bytes), got {memory_budget!r}")
        self.backend = backend or EagerBackend()
        self.batch_buckets = tuple(batch_buckets)
        self.token_buckets = tuple(token_buckets)
        self.context_buckets = tuple(context_buckets)
        self.table_context_buckets = tuple(table_context_buckets)
        self.memory_budget = memory_budget
        self.stats = PoolStats()
        self._entries: OrderedDict[GraphKey, CapturedForward] = OrderedDict()
        self._owner = threading.get_ident()
        # buckets another thread ran uncaptured, with its inputs' signature, for the owner to capture
        self._missed: dict[GraphKey, InputSignature] = {}
        # what must hold across a capture, whose warm-up runs the forward (a recurrent model's states,
        # ``model_support.recurrent_states_for``): entered around each capture with its inputs
        self.preserve: Callable[[Inputs], AbstractContextManager] | None = None

    def key_for(self, num_seqs: int, tokens: int, context: int, reads_tables: bool = False) -> GraphKey | None:
        """The bucket a forward pads to, or None if it is larger than every bucket.

        ``reads_tables``: its attention reads block tables (the split-KV kernel), whose work follows
        each sequence's own context; the bucket then sets only the tables' width and the split
        count, so coarse ``table_context_buckets`` serve it: a rollout crossing contexts 256, 512
        and 1024 captures each batch and width once instead of three times (a capture costs tens
        of steps), where a gathering attention copies its whole bucket each step."""
        b = _round_up(num_seqs, self.batch_buckets)
        t = _round_up(tokens, self.token_buckets)
        c = _round_up(context, self.table_context_buckets if reads_tables else self.context_buckets)
        return None if b is None or t is None or c is None else GraphKey(b, t, c)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def replay(self, key: GraphKey) -> bool:
        """Replay the forward held for ``key`` on the inputs it last ran (staging nothing, not
        moved in the LRU order): its device work alone, for measurements. False if none is held."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.replay()
        return entry is not None

    def take_missed(self) -> dict[GraphKey, InputSignature]:
        """The buckets other threads ran uncaptured since the last call (not captured since), with
        the signature of the inputs they ran with; the record is emptied."""
        with _capture_lock:
            missed, self._missed = self._missed, {}
        return {key: signature for key, signature in missed.items() if key not in self._entries}

    def _uncaptured(self, make_fn: Callable[[], ForwardFn], inputs: Inputs) -> Outputs:
        self.stats.uncaptured += 1
        with _capture_lock:
            _uncaptured_count[0] += 1
        return make_fn()(self._on_device(inputs))

    def keys(self) -> list[GraphKey]:
        """Held keys, least recently used first."""
        return list(self._entries)

    def run(self, key: GraphKey | None, make_fn: Callable[[], ForwardFn], inputs: Inputs) -> Outputs:
        """Replay the forward captured for ``key`` on ``inputs`` (already padded to the bucket),
        capturing it first if needed. ``key=None`` runs ``make_fn()`` eagerly, uncaptured."""
        if key is None:
            return self._uncaptured(make_fn, inputs)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry.run(inputs)
        if threading.get_ident() != self._owner:
            # captures happen on the thread that made the pool: a draft executor's thread replays
            # what is held and runs other shapes eagerly, so two captures never overlap (another
            # thread's work during a capture invalidates it); the owner may capture
            # the bucket later, when the other thread is idle (take_missed)
            with _capture_lock:
                self._missed.setdefault(key, input_signature(inputs))
            return self._uncaptured(make_fn, inputs)
        start = time.perf_counter()
        with self.preserve(inputs) if self.preserve is not None else nullcontext():
            entry = self.backend.capture(make_fn(), inputs)
        self.stats.capture_s[key] = took = time.perf_counter() - start
        self.stats.captures += 1
        with _capture_lock:
            _capture_clock[0] += took
        if entry.nbytes > self.memory_budget:
            logger.warning("graph for %s needs %d bytes, over the whole budget; not kept", key, entry.nbytes)
            return entry.run(inputs)
        self._entries[key] = entry
        self.stats.bytes += entry.nbytes
        self._evict_to_budget(keep=key)
        return entry.run(inputs)

    def _on_device(self, inputs: Inputs) -> Inputs:
        return {name: to_device(tensor, self.backend.device) for name, tensor in inputs.items()}

    def _evict_to_budget(self, keep: GraphKey) -> None:
        while self.stats.bytes > self.memory_budget:
            victim = next(k for k in self._entries if k != keep)
            entry = self._entries.pop(victim)
            self.stats.bytes -= entry.nbytes
            self.stats.evictions += 1

    def clear(self) -> None:
        """Drop every entry (e.g. after the model's weights were replaced by new tensors)."""
        self._entries.clear()
        self.stats.bytes = 0


def graph_pool_for(model: torch.nn.Module, config: Any) -> GraphPool | None:
    """The pool ``config.graph_backend`` asks for (a ``RolloutConfig``): captured CUDA graphs on
    CUDA by default, none on CPU; eager buckets on request."""
    backend = config.graph_backend
    on_cuda = next(model.parameters()).device.type == "cuda"
    if backend == "none" or (backend == "auto" and not on_cuda):
        return None
    if backend == "cuda_graph" and not on_cuda:
        raise ValueError("RolloutConfig.graph_backend='cuda_graph' needs the model on a CUDA device")
    device = next(model.parameters()).device
    chosen = CudaGraphBackend(device) if backend in ("auto", "cuda_graph") else EagerBackend(device)
    return GraphPool(chosen, memory_budget=config.graph_memory_mb << 20)
