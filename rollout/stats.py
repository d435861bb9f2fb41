"""What an engine counts: per-step records and the running totals behind ``RolloutEngine.stats``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Drafted:
    """A speculative step's drafts, per sequence: the draft tokens verified, how many were
    accepted, and its tree's first branch (depth, kept): what ``adaptive`` learns acceptance from."""

    drafted: list[int]
    accepted: list[int]
    branches: list[tuple[int, int]]


@dataclass
class SpecStepRecord:
    """What one speculative step did (kept in ``EngineStats.spec_log``)."""

    strategy: str
    batch_size: int
    drafted: int
    accepted: int
    emitted: int
    draft_s: float
    verify_s: float


@dataclass(frozen=True)
class StepRecord:
    """One decode step: how many sequences ran, with which strategy, what it emitted and cost."""

    num_active: int
    strategy: str
    emitted: int
    seconds: float
    in_tail: bool


def acceptance_rate(accepted_tokens: int, drafted_tokens: int) -> float:
    """Accepted over drafted tokens (0.0 before any draft)."""
    return accepted_tokens / drafted_tokens if drafted_tokens else 0.0


@dataclass
class EngineCounts:
    """What an engine counted: its running totals, or what a span of its work added (``after -
    before``), summed over engines with ``+``. The one record that goes from an engine to the
    trainer's logs, in this process or from Ray workers through the coordinator."""

    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    forked_prefills: int = 0  # group members that reused a leader's prefill
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache (RolloutConfig.prefix_caching)
    mixed_steps: int = 0  # prefills that also advanced the running sequences (RolloutConfig.mixed_batches)
    # steps (prefill or decode) launched before the step before them was committed, and their rows of sequences
    # that had finished meanwhile, computed and dropped (``rollout/launched.py``)
    overlapped_steps: int = 0
    dropped_rows: int = 0
    model_time_s: float = 0.0
    wall_time_s: float = 0.0
    spec_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    spec_emitted_tokens: int = 0  # tokens emitted by speculative steps (accepted + one per sequence)
    spec_seq_steps: int = 0  # sequence-steps inside speculative steps
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    tail_steps: int = 0
    tail_time_s: float = 0.0
    decode_time_s: float = 0.0
    decode_model_time_s: float = 0.0  # target forwards inside decode steps (the rest: drafting and bookkeeping)
    commit_time_s: float = 0.0  # steps' commits: reading their tokens and the host's bookkeeping after
    capture_time_s: float = 0.0  # of decode steps' time, what graph pools spent capturing (target's and drafter's)
    calibration_time_s: float = 0.0  # adaptive's forward table timed (before a rollout, or on a switch to adaptive)
    strategy_steps: dict[str, int] = field(default_factory=dict)  # decode steps per strategy

    def counts(self) -> EngineCounts:
        """A copy of the counts alone (an :class:`EngineStats` drops its logs)."""
        return EngineCounts(**{name: _copied(getattr(self, name)) for name in _COUNT_NAMES})

    def __sub__(self, earlier: EngineCounts) -> EngineCounts:
        steps = {k: v - earlier.strategy_steps.get(k, 0) for k, v in self.strategy_steps.items()}
        return EngineCounts(
            **{name: getattr(self, name) - getattr(earlier, name) for name in _NUMBERS},
            strategy_steps={k: v for k, v in steps.items() if v > 0},
        )

    def __add__(self, other: EngineCounts) -> EngineCounts:
        steps = dict(self.strategy_steps)
        for k, v in other.strategy_steps.items():
            steps[k] = steps.get(k, 0) + v
        return EngineCounts(
            **{name: getattr(self, name) + getattr(other, name) for name in _NUMBERS}, strategy_steps=steps
        )

    @property
    def mean_accept_length(self) -> float:
        """Tokens a sequence gained per speculative step (1.0 without one)."""
        return self.spec_emitted_tokens / self.spec_seq_steps if self.spec_seq_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted_tokens, self.drafted_tokens)


_COUNT_NAMES = tuple(f.name for f in fields(EngineCounts))
_NUMBERS = tuple(name for name in _COUNT_NAMES if name != "strategy_steps")


def _copied(value):
    return dict(value) if isinstance(value, dict) else value


@dataclass
class EngineStats(EngineCounts):
    """An engine's running counts and its recent per-step logs (``RolloutEngine.stats``)."""

    batch_sizes: list[int] = field(default_factory=list)
    spec_log: deque[SpecStepRecord] = field(default_factory=lambda: deque(maxlen=4096))
    step_log: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=65536))

    def as_dict(self) -> dict[str, float]:
        skip = ("batch_sizes", "spec_log", "step_log", "strategy_steps")
        d = {k: v for k, v in self.__dict__.items() if k not in skip}
        d["mean_decode_batch"] = sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0
        d["tokens_per_s"] = self.generated_tokens / self.wall_time_s if self.wall_time_s else 0.0
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accept_length"] = self.mean_accept_length
        return d

    def record_spec_step(
        self, strategy: str, num_seqs: int, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float
    ) -> None:
        self.decode_steps += 1
        self.spec_steps += 1
        self.batch_sizes.append(num_seqs)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.spec_emitted_tokens += emitted
        self.spec_seq_steps += num_seqs
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s
        self.spec_log.append(SpecStepRecord(strategy, num_seqs, drafted, accepted, emitted, draft_s, verify_s))

    def record_decode_step(self, record: StepRecord) -> None:
        self.decode_time_s += record.seconds
        if record.in_tail:
            self.tail_steps += 1
            self.tail_time_s += record.seconds
        self.strategy_steps[record.strategy] = self.strategy_steps.get(record.strategy, 0) + 1
        self.step_log.append(record)
