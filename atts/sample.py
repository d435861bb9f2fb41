"""One ATTS sample's turn loop as a small state machine, shared by the asynchronous runner and the
synchronous baseline: it says which request to send next and folds each answer back in.

Token ids are never re-tokenized: the history is the exact ids the models wrote, so a chunk scored
at offset ``len(prompt_ids) + len(history)`` of the scoring input is exactly the drafted ids.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

from ..rollout.params import SamplingParams
from .config import ATTSConfig


class Phase(str, enum.Enum):
    DRAFT = "draft"  # the draft model is writing a chunk
    SCORE = "score"  # the target is scoring the drafted chunk
    TAKEOVER = "takeover"  # the target is writing the chunk in place of the rejected draft
    DONE = "done"


class Author(str, enum.Enum):
    DRAFT = "draft"
    TARGET = "target"


@dataclass(frozen=True)
class Turn:
    """One kept chunk. ``draft_ids``/``score``/``offset`` describe the scored draft chunk (for a
    takeover turn, the rejected one); ``token_ids`` is what entered the history."""

    index: int
    author: Author
    token_ids: tuple[int, ...]
    draft_ids: tuple[int, ...]
    score: float | None
    offset: int  # where draft_ids start in the scoring input (= history length before the turn + prompt)
    scored_ids: tuple[int, ...]  # the tokens whose log-probabilities the target returned
    threshold: float
    level: float


@dataclass(frozen=True)
class ScoreRequest:
    input_ids: list[int]
    offset: int  # the chunk is input_ids[offset:]


def request_seed(base: int, sample_id: int, turn: int, role: str) -> int:
    """A per-request seed that does not depend on scheduling order (reproducible async runs)."""
    digest = hashlib.blake2b(f"{base}/{sample_id}/{turn}/{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class SampleState:
    sample_id: int
    question_index: int
    prompt_ids: list[int]
    config: ATTSConfig
    eos_ids: frozenset[int]
    history: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    phase: Phase = Phase.DRAFT
    finish_reason: str | None = None
    pending_chunk: list[int] = field(default_factory=list)
    pending_score: float | None = None
    pending_offset: int = 0
    pending_scored: tuple[int, ...] = ()
    pending_decision: tuple[float, float] = (0.0, 0.0)

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def num_takeovers(self) -> int:
        return sum(t.author is Author.TARGET for t in self.turns)

    def _chunk_params(self, role: str) -> SamplingParams:
        c = self.config
        return SamplingParams(
            temperature=c.temperature,
            top_p=c.top_p,
            max_new_tokens=min(c.chunk_tokens, c.max_new_tokens - len(self.history)),
            stop_token_ids=c.delimiter_ids,
            seed=request_seed(c.seed, self.sample_id, len(self.turns), role),
        )

    def context(self) -> list[int]:
        return self.prompt_ids + self.history

    def draft_request(self) -> tuple[list[int], SamplingParams]:
        return self.context(), self._chunk_params("draft")

    def takeover_request(self) -> tuple[list[int], SamplingParams]:
        return self.context(), self._chunk_params("target")

    def score_request(self, chunk: list[int]) -> tuple[ScoreRequest, SamplingParams]:
        """The chunk after the question and history, scored by one prefill (one token generated
        greedily and discarded)."""
        context = self.context()
        return ScoreRequest(context + chunk, len(context)), SamplingParams(
            temperature=0.0, max_new_tokens=1, prompt_logprobs=len(chunk), ignore_eos=True
        )

    def on_draft(self, chunk: list[int]) -> tuple[ScoreRequest, SamplingParams]:
        if self.phase is not Phase.DRAFT:
            raise RuntimeError(f"sample {self.sample_id}: draft chunk arrived in phase {self.phase.value}")
        if not chunk:
            raise RuntimeError(f"sample {self.sample_id}: empty draft chunk")
        self.pending_chunk = list(chunk)
        self.phase = Phase.SCORE
        return self.score_request(self.pending_chunk)

    def on_score(self, request: ScoreRequest, chunk_logprobs: list[float]) -> float:
        """The chunk's score: mean negative log-likelihood of its tokens under the target."""
        if self.phase is not Phase.SCORE:
            raise RuntimeError(f"sample {self.sample_id}: score arrived in phase {self.phase.value}")
        scored = tuple(request.input_ids[request.offset :])
        if scored != tuple(self.pending_chunk) or len(chunk_logprobs) != len(scored):
            raise RuntimeError(f"sample {self.sample_id}: the scored span is not the drafted chunk")
        self.pending_score = -sum(chunk_logprobs) / len(chunk_logprobs)
        self.pending_offset = request.offset
        self.pending_scored = scored
        return self.pending_score

    def on_decision(self, takeover: bool, threshold: float, level: float) -> None:
        if self.phase is not Phase.SCORE:
            raise RuntimeError(f"sample {self.sample_id}: decision in phase {self.phase.value}")
        self.pending_decision = (threshold, level)
        if takeover:
            self.phase = Phase.TAKEOVER
        else:
            self._keep(Author.DRAFT, self.pending_chunk)

    def on_takeover(self, chunk: list[int]) -> None:
        if self.phase is not Phase.TAKEOVER:
            raise RuntimeError(f"sample {self.sample_id}: takeover chunk arrived in phase {self.phase.value}")
        self._keep(Author.TARGET, list(chunk))

    def _keep(self, author: Author, chunk: list[int]) -> None:
        threshold, level = self.pending_decision
        self.turns.append(
            Turn(
                index=len(self.turns),
                author=author,
                token_ids=tuple(chunk),
                draft_ids=tuple(self.pending_chunk),
                score=self.pending_score,
                offset=self.pending_offset,
                scored_ids=self.pending_scored,
                threshold=threshold,
                level=level,
            )
        )
        self.history.extend(chunk)
        self.pending_chunk, self.pending_score = [], None
        if chunk and chunk[-1] in self.eos_ids:
            self._finish("stop")
        elif len(self.history) >= self.config.max_new_tokens:
            self._finish("length")
        elif len(self.turns) >= self.config.max_turns:
            self._finish("turn_limit")
        else:
            self.phase = Phase.DRAFT

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.phase = Phase.DONE
