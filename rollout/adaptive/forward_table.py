"""The target forward's seconds per shape, as calibration timed them: the first term of every
arm's predicted step (``cost_model.py`` adds the drafting, the host's part and the corrections).

Each ``(sequences, tokens)`` shape is timed once at calibration (:func:`calibrate`: the median of
a few runs, after the graph pool captured it) at a short context and interpolated between measured
batch sizes and token widths (:class:`ForwardTable`); under CUDA graphs a shape is first padded to
its bucket, so step time is the step function the replays really are.

A step's context moves its cost too: attention reads every cached token of every sequence, so a
rollout's long tail, at a few thousand tokens, costs more per step than its first steps did, and
more for every arm alike. Each width is also timed at a longer context, which gives its seconds
per sequence per cached token beyond the short one (:meth:`ForwardTable.seconds` adds them for a
step's mean context); without that, the arm that ran last would carry the whole rise in its
correction, and the arms that did not run would look cheaper than they are.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections.abc import Callable, Iterable

Shape = tuple[int, int]  # (sequences, tokens per sequence)
Pad = Callable[[int, int], Shape]


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through ``(xs, ys)`` (sorted xs, non-decreasing ys); the first value below
    the first point, the last segment's slope past the last point."""
    if x <= xs[0]:
        return ys[0]
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def monotone(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence (pool adjacent violators): a forward never gets cheaper
    with more rows, so a noisy timing below an earlier one is averaged with it, not trusted."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


class ForwardTable:
    """Seconds of a target forward per measured ``(sequences, tokens)`` shape, interpolated in the
    batch size for each measured width, then between widths; ``pad`` maps a shape to the one that
    actually runs (a graph bucket), so predictions there are the measured replays. The shapes were
    timed at ``context`` cached tokens; ``per_token[t]``: a sequence's seconds per cached token
    beyond it at width ``t`` (none measured: the context is not priced)."""

    def __init__(
        self,
        seconds: dict[Shape, float],
        pad: Pad | None = None,
        context: int = 0,
        per_token: dict[int, float] | None = None,
    ) -> None:
        if not seconds:
            raise ValueError("a forward table needs at least one measured shape")
        self.measured = dict(seconds)
        self.pad = pad
        self.context = context
        self.per_token = dict(per_token or {})
        self._slope_widths = sorted(self.per_token)
        self._slopes = monotone([self.per_token[t] for t in self._slope_widths])
        columns: dict[int, tuple[list[int], list[float]]] = {}
        for (n, t), s in sorted(seconds.items()):
            column = columns.setdefault(t, ([], []))
            column[0].append(n)
            column[1].append(s)
        self._columns = {t: (ns, monotone(ys)) for t, (ns, ys) in columns.items()}
        self._widths = sorted(self._columns)
        self._known: dict[Shape, float] = {}  # answers so far: every adaptive step asks for each arm's
        self._slope_at: dict[int, float] = {}  # per width: a sequence's seconds per cached token

    def seconds(self, n: int, t: int, context: float | None = None) -> float:
        """A forward of ``n`` sequences of ``t`` new tokens, their mean context ``context`` cached
        tokens (None: the calibration's)."""
        if self.pad is not None:
            n, t = self.pad(n, t)
        seconds = self._known.get((n, t))
        if seconds is None:
            at = monotone([_interpolate(*self._columns[w], n) for w in self._widths])
            seconds = self._known[(n, t)] = _interpolate(self._widths, at, t)
        if context is not None and self._slope_widths:
            slope = self._slope_at.get(t)
            if slope is None:
                slope = self._slope_at[t] = _interpolate(self._slope_widths, self._slopes, t)
            # a shorter context than calibration's saves at most half the forward (its weights' part stays)
            seconds = max(seconds + n * slope * (context - self.context), seconds / 2)
        return seconds


def batch_grid(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch``, and ``max_batch`` itself."""
    grid = [1 << i for i in range(max(max_batch, 1).bit_length()) if 1 << i <= max_batch]
    return sorted({*grid, max(max_batch, 1)})


def calibration_shapes(widths: Iterable[int], max_batch: int, max_rows: int, pad: Pad | None = None) -> list[Shape]:
    """The shapes to time: every width the arms verify, at batch sizes doubling up to ``max_batch``.
    Without graphs (``pad`` None), only while the forward stays within ``max_rows`` rows (at least
    two batch sizes per width, so the table extrapolates; beyond them a CPU forward grows linearly
    in its rows); with graphs, every bucket, each of which a rollout would otherwise capture."""
    shapes: set[Shape] = set()
    for t in sorted(set(widths)):
        grid = batch_grid(max_batch)
        kept = [n for i, n in enumerate(grid) if i < 2 or n * t <= max_rows or pad is not None]
        shapes |= {pad(n, t) if pad is not None else (n, t) for n in kept}
    return sorted(shapes, key=lambda s: (s[1], s[0]))


def calibrate(time_forward: Callable[[int, int], float], shapes: Iterable[Shape], repeats: int) -> dict[Shape, float]:
    """The median of ``repeats`` timings of each shape (``time_forward(n, t)`` -> seconds)."""
    return {shape: statistics.median(time_forward(*shape) for _ in range(repeats)) for shape in shapes}
