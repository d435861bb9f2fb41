"""A step launched and not yet committed: the one value the engine's loop hands from one iteration
to the next (``in_flight = step(schedule(), in_flight)``, as mini-sglang's loop hands its ongoing
batch on).

Every step, prefill or decode, plain or speculative, from any drafter, is launched and returns a
:class:`Launched` record. Its :meth:`~Launched.commit` is the only place a step's tokens, logprobs,
stops and finished requests reach the host. The loop launches step N + 1, then commits step N, so
the host's half of step N runs while the device computes step N + 1. Whoever must see the host's
state exact before that (a step whose drafter drafts from text, a preemption, an abort, a release,
a weight update) commits the record early; a commit runs once, and later calls return its result.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .request import SeqStatus, Sequence
from .stats import Drafted, EngineStats


@dataclass(frozen=True)
class Committed:
    """What a step's commit brought to the host: the requests it finished, the tokens it appended,
    and what its drafts were and kept (None for a plain step)."""

    finished: list[int] = field(default_factory=list)
    emitted: int = 0
    drafted: Drafted | None = None


class StepClock:
    """A step's own cost: the host seconds of its launch (less the commits of other steps inside
    it) and of its commit, and on CUDA the device's seconds between two events recorded around its
    launch (read when the step is retired, long done). ``adaptive`` learns its arms' costs from it."""

    def __init__(self, device: torch.device) -> None:
        self.launch_s = 0.0
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._started = time.perf_counter()

    def launched(self, others_commits_s: float) -> None:
        self.launch_s = time.perf_counter() - self._started - others_commits_s
        if self._events is not None:
            self._events[1].record()

    def seconds(self, commit_s: float) -> float:
        """The step's cost: its host seconds, or on CUDA its device seconds where they are more (when
        the device has passed the second event: asked, never waited for)."""
        host = self.launch_s + commit_s
        if self._events is None or not self._events[1].query():
            return host
        return max(host, self._events[0].elapsed_time(self._events[1]) / 1000)


class Launched(ABC):
    """A step launched over ``seqs``: what it computes is queued on the device, and what reaches the
    host does at :meth:`commit`."""

    #: the seconds it spent drafting, and in the target's forward where the host measured them apart
    #: from the host's own work (None where the device runs them after the launch returns)
    draft_s: float = 0.0
    forward_s: float | None = None

    def __init__(self, seqs: list[Sequence], stats: EngineStats) -> None:
        self.seqs, self.stats = seqs, stats
        self.clock: StepClock | None = None  # a decode step's, set by ``StepMeter`` at its launch
        self.plan = None  # what a decode step was launched under (``StepMeter``)
        self.commit_s = 0.0
        self.after_commit: Callable[[], None] | None = None  # what learns from the host's state right after
        self._committed: Committed | None = None

    @property
    def committed(self) -> bool:
        return self._committed is not None

    def commit(self) -> Committed:
        """Bring the step's tokens to the host (waiting for them): append them up to each sequence's
        stop, finish the requests they finished. Runs once; later calls return what it did."""
        if self._committed is None:
            start = time.perf_counter()
            self._committed = self._commit()
            self.commit_s = time.perf_counter() - start
            self.stats.commit_time_s += self.commit_s
            if self.after_commit is not None:
                self.after_commit()
        return self._committed

    @abstractmethod
    def _commit(self) -> Committed: ...

    def unread(self, seq: Sequence) -> int:
        """Tokens known to be sampled here for ``seq`` that its ``output_ids`` do not hold yet."""
        return 0

    def cache_ahead(self, seq: Sequence) -> int:
        """How far past ``seq.num_cached`` this step's commit may move it (0 once committed): what a
        step scheduled before that commit reserves blocks for."""
        return 0

    def holds_final(self, seq: Sequence) -> bool:
        """Whether ``seq``'s final token (``max_new_tokens``) is in this step, not yet committed: it
        takes no further step."""
        return False

    @cached_property
    def _row_of(self) -> dict[int, int]:
        return {id(seq): row for row, seq in enumerate(self.seqs)}

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` has a row in this step."""
        return id(seq) in self._row_of

    def rows_of(self, seqs: Seq[Sequence]) -> list[int] | None:
        """Each of ``seqs``' row in this step, None if one of them is not in it."""
        rows = [self._row_of.get(id(seq)) for seq in seqs]
        return None if None in rows else rows


def committed_first(seqs: Seq[Sequence], previous: Launched | None) -> list[Sequence]:
    """Commit ``previous`` (if nothing did yet); those of ``seqs`` still running (the others
    stopped on its tokens)."""
    if previous is not None:
        previous.commit()
    return [seq for seq in seqs if seq.status is SeqStatus.RUNNING]
