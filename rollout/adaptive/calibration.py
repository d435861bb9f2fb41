"""Times the target's verification forward per shape for the selector's cost model
(``rollout/adaptive/cost_model.py``), on scratch KV blocks taken from the free pool and given back.

Under a graph pool each shape is padded to its bucket and run once before timing (the capture), so
what is timed are replays, and the graphs a rollout needs are held before it starts.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ..model.attention import SequenceSlice
from ..model.kv_cache import blocks_for
from ..model.runner import Forward, ModelRunner
from ..strategy import Strategy
from .forward_table import ForwardTable, Pad, calibrate, calibration_shapes
from .selector import SelectorConfig

logger = logging.getLogger(__name__)

CONTEXT = 128  # cached tokens per scratch sequence: a short context, as a rollout's first steps see
LONG_CONTEXT = 1024  # the longer context each scratch sequence also has, for the cost of a cached token
# eager timings of this process, by model architecture and shapes: an engine on the same kind of
# model reuses them (step costs are the hardware's and the shapes'); graph pools always calibrate,
# since calibration is also what captures their graphs
_EAGER_TIMINGS: dict[tuple, dict] = {}


def graph_padding(runner: ModelRunner, context: int, kernels: str) -> Pad | None:
    """The shape a forward of ``(n, t)`` runs as: its graph bucket, or itself without graphs."""
    if runner.graph_pool is None:
        return None

    def pad(n: int, t: int) -> tuple[int, int]:
        key = runner.graph_key(n, t, context + t, kernels)
        return (key.batch, key.tokens) if key is not None else (n, t)

    return pad


def scratch_fit(free_blocks: int, block_size: int, n: int, width: int, context: int = CONTEXT) -> tuple[int, int]:
    """``(batch, context)``: the most of ``n`` scratch sequences of ``width`` new tokens that
    ``free_blocks`` hold, and the longest context up to ``context`` at which they fit (a small
    cache times shorter contexts or fewer sequences rather than running out of blocks); batch 0:
    not even one sequence fits."""
    batch = min(n, free_blocks // blocks_for(width, block_size))
    if batch == 0:
        return 0, 0
    per_seq = free_blocks // batch
    return batch, max(0, min(context, per_seq * block_size - width))


def forward_timer(
    runner: ModelRunner, block_size: int, context: int, forward: Forward | None = None
) -> Callable[[int, int], float]:
    """``time(n, t)``: seconds of one forward of ``n`` sequences with ``t`` new tokens each
    (``forward``: the engine's, which taps a drafter's features; the runner's by default)."""
    allocator, on_cuda = runner.cache.allocator, runner.device.type == "cuda"
    forward = forward or runner.forward

    def time_forward(n: int, t: int) -> float:
        per_seq = blocks_for(context + t, block_size)
        blocks = allocator.allocate(n * per_seq)
        try:
            slices = [SequenceSlice(blocks[i * per_seq : (i + 1) * per_seq], context, t) for i in range(n)]
            positions = [context + j for _ in range(n) for j in range(t)]
            if on_cuda:
                torch.cuda.synchronize(runner.device)
            start = time.perf_counter()
            forward(slices, [0] * (n * t), positions, list(range(n * t)))
            if on_cuda:
                torch.cuda.synchronize(runner.device)
            return time.perf_counter() - start
        finally:
            allocator.free(blocks)

    return time_forward


def context_slopes(
    runner: ModelRunner,
    block_size: int,
    shapes: Sequence[tuple[int, int]],
    context: int,
    forward: Forward | None,
    repeats: int,
) -> dict[int, float]:
    """A sequence's seconds per cached token beyond ``context``, at the narrowest and the widest
    width of ``shapes`` (a forward's attention grows with its rows times their context, so the
    table interpolates between the two): each timed at its largest batch in ``shapes``, at
    ``context`` and at a longer one (up to :data:`LONG_CONTEXT`, what the free blocks hold), the
    two interleaved, their medians compared after one untimed run of each (a graph's capture, the
    allocator's growth to the longer context). Widths for which no much longer context fits are
    left out."""
    free = runner.cache.allocator.num_free
    widths = sorted({t for _, t in shapes})
    slopes = {}
    for t in sorted({widths[0], widths[-1]}):
        batch, long = scratch_fit(free, block_size, max(n for n, w in shapes if w == t), t, LONG_CONTEXT)
        if batch == 0 or long < max(2 * context, context + 4 * block_size):
            continue
        timers = forward_timer(runner, block_size, context, forward), forward_timer(runner, block_size, long, forward)
        for timer in timers:
            timer(batch, t)
        pairs = [(timers[0](batch, t), timers[1](batch, t)) for _ in range(repeats)]
        short_s, long_s = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        slopes[t] = max(0.0, (long_s - short_s) / (batch * (long - context)))
    return slopes


def calibrate_costs(
    runner: ModelRunner,
    config: SelectorConfig,
    arms: Sequence[Strategy],
    block_size: int,
    max_batch: int,
    kernels: str,
    known: ForwardTable | None = None,
    fresh: bool = False,
    forward: Forward | None = None,
    taps: tuple[int, ...] = (),
) -> ForwardTable:
    """Time every verification width of ``arms`` at batch sizes up to ``max_batch`` (or what the
    free KV blocks hold) with ``forward`` (the engine's, tapping layers ``taps`` for its drafter),
    and what a longer context adds (:func:`context_slopes`). Shapes and slopes ``known`` measured
    are kept as they are (a table extended to a larger batch); ``fresh``: time even what this
    process timed on the same kind of model."""
    widths = sorted({1 + a.max_draft_nodes for a in arms})
    free = runner.cache.allocator.num_free
    _, context = scratch_fit(free, block_size, 1, widths[-1])  # a small cache: a shorter context
    max_batch = max(1, min(max_batch, free // blocks_for(context + widths[-1], block_size)))
    pad = graph_padding(runner, context, kernels)
    shapes = calibration_shapes(widths, max_batch, config.calibration_rows, pad)
    shapes = [s for s in shapes if s[0] * blocks_for(context + s[1], block_size) <= free]
    kept = {s: v for s, v in known.measured.items() if s in shapes} if known is not None else {}
    slopes = known.per_token if known is not None and known.context == context else None
    key = (runner.model.config.to_json_string(), str(runner.dtype), str(runner.device), kernels, context, taps)
    key += (tuple(shapes), config.calibration_repeats)
    if pad is None and not fresh and key in _EAGER_TIMINGS:  # what ``known`` holds stays as it is
        measured, timed_slopes = _EAGER_TIMINGS[key]
        return ForwardTable({**measured, **kept}, None, context, slopes if slopes is not None else timed_slopes)
    todo = [s for s in shapes if s not in kept]
    timer = forward_timer(runner, block_size, context, forward)
    start = time.perf_counter()
    with runner.inference(kernels):
        if pad is not None:
            for shape in todo:  # capture first: the timings are replays
                timer(*shape)
        measured = {**kept, **calibrate(timer, todo, config.calibration_repeats)}
        if slopes is None:
            slopes = context_slopes(runner, block_size, shapes, context, forward, config.calibration_repeats)
    if pad is None:
        _EAGER_TIMINGS[key] = (measured, slopes)
    logger.info(
        "adaptive: calibrated %d forward shapes (batch <= %d, widths %s; %d kept) in %.2fs; per cached token "
        "and sequence %s",
        len(todo),
        max_batch,
        widths,
        len(kept),
        time.perf_counter() - start,
        {t: f"{1e6 * v:.3f} us" for t, v in slopes.items()},
    )
    return ForwardTable(measured, pad, context, slopes)
