"""Request state inside the engine, and what the engine returns for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .handoff import PartialRequest
from .params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS or stop token was emitted (and kept)
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # cancelled by the caller


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: two requests are never "equal"
class Sequence:
    """One request's mutable state: its tokens, its KV blocks and its randomness."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    group: int | None = None  # requests with the same prompt in one call share a group id
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # of the last params.prompt_logprobs prompt tokens
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    state_slot: int = 0  # its slot of the model's recurrent state while it runs (0: none, model/recurrent_state.py)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    cache_epoch: int = 0  # the prefix-cache epoch (weights) its K/V was computed under
    num_spec_steps: int = 0  # speculative steps this sequence took part in
    num_drafted: int = 0  # draft tokens verified for it
    num_accepted: int = 0  # of those, accepted
    expected_length: float | None = None  # predicted completion length (a scheduling hint, never a limit)

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, index: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[index] if index < p else self.output_ids[index - p]

    def uncached_tokens(self) -> list[int]:
        return (self.prompt_ids + self.output_ids)[self.num_cached :]

    @property
    def is_fresh(self) -> bool:
        """Never run (or fully preempted before producing output)."""
        return not self.output_ids and self.num_cached == 0

    def append(self, token: int, logprob: float) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def to_partial(self) -> PartialRequest:
        """This request's state, to continue it on another engine (:mod:`tailspec.rollout.handoff`)."""
        return PartialRequest(
            prompt_ids=list(self.prompt_ids),
            params=self.params,
            output_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            generator_state=self.generator.get_state() if self.generator is not None else None,
            num_preemptions=self.num_preemptions,
            num_spec_steps=self.num_spec_steps,
            num_drafted=self.num_drafted,
            num_accepted=self.num_accepted,
        )

    def resume_from(self, partial: PartialRequest) -> None:
        """Continue ``partial`` here: its tokens wait to be recomputed, its draws go on where they stopped."""
        self.output_ids, self.logprobs = list(partial.output_ids), list(partial.logprobs)
        self.prompt_logprobs = None if partial.prompt_logprobs is None else list(partial.prompt_logprobs)
        if partial.generator_state is not None:
            self.generator = torch.Generator()
            self.generator.set_state(partial.generator_state)
        self.num_preemptions = partial.num_preemptions
        self.num_spec_steps, self.num_drafted = partial.num_spec_steps, partial.num_drafted
        self.num_accepted = partial.num_accepted

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.seq_id,
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            num_preemptions=self.num_preemptions,
            num_spec_steps=self.num_spec_steps,
            num_drafted=self.num_drafted,
            num_accepted=self.num_accepted,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )


@dataclass
class RequestOutput:
    request_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # processed log-probability of each completion token
    finish_reason: str | None
    num_preemptions: int = 0
    num_spec_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    # unprocessed log-probabilities of the last SamplingParams.prompt_logprobs prompt tokens
    prompt_logprobs: list[float] | None = None

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per speculative step (accepted drafts plus the target's own token)."""
        return (self.num_accepted + self.num_spec_steps) / self.num_spec_steps if self.num_spec_steps else 1.0
