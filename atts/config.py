"""ATTSConfig: how samples are drafted, scored and taken over."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config_tree import is_int, require

TAKEOVER_MODES = ("split", "online")


@dataclass(frozen=True)
class ATTSConfig:
    """One ATTS run.

    Each of ``num_samples`` samples per question runs a turn loop: the draft model writes a chunk
    of at most ``chunk_tokens`` tokens, ending early after any of ``delimiter_ids`` (a reasoning
    step) or an EOS; the target scores the chunk (mean negative log-likelihood of its tokens given
    the question and the history, one prefill); the conformal test at level ``alpha`` accepts the
    chunk or discards it and lets the target write that chunk instead. A sample stops at an EOS,
    after ``max_new_tokens`` tokens in all, or after ``max_turns`` turns.

    ``mode`` is ``"split"`` (split conformal: the calibration set is fixed; each draft chunk
    exchangeable with the calibration chunks is taken over with probability at most ``alpha`` and
    at least ``alpha - 1/(n+1)``) or ``"online"`` (adaptive conformal inference: the level used is
    nudged by ``online_step`` after every decision so the long-run takeover rate tracks ``alpha``
    even when the scores drift; no per-decision guarantee).
    """

    alpha: float = 0.2
    num_samples: int = 8
    chunk_tokens: int = 32
    delimiter_ids: tuple[int, ...] = ()
    max_new_tokens: int = 512
    max_turns: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    mode: str = "split"
    online_step: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        a = self.alpha
        require(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 < a < 1, "alpha", "in (0, 1)", a)
        require(is_int(self.num_samples) and self.num_samples >= 1, "num_samples", "an int >= 1", self.num_samples)
        require(is_int(self.chunk_tokens) and self.chunk_tokens >= 1, "chunk_tokens", "an int >= 1", self.chunk_tokens)
        try:
            delimiters = tuple(self.delimiter_ids)
        except TypeError:
            delimiters = None
        require(
            delimiters is not None and all(is_int(d) and d >= 0 for d in delimiters),
            "delimiter_ids",
            "a sequence of token ids >= 0",
            self.delimiter_ids,
        )
        object.__setattr__(self, "delimiter_ids", delimiters)
        require(
            is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens",
            "an int >= 1",
            self.max_new_tokens,
        )
        require(is_int(self.max_turns) and self.max_turns >= 1, "max_turns", "an int >= 1", self.max_turns)
        t = self.temperature
        require(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0,
            "temperature",
            "a finite number >= 0 (0 = greedy)",
            t,
        )
        require(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        require(self.mode in TAKEOVER_MODES, "mode", f"one of {TAKEOVER_MODES}", self.mode)
        s = self.online_step
        require(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s < 1, "online_step", "in (0, 1)", s)
        require(is_int(self.seed) and 0 <= self.seed < 2**62, "seed", "an int in [0, 2**62)", self.seed)
