"""The engine's requests by id: admission into the scheduler, and what finishing, aborting or handing
one over to another engine releases (told to a :class:`SequenceListener`: the drafting state)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from .admission import RequestLimits
from .handoff import PartialRequest
from .params import SamplingParams
from .request import FinishReason, RequestOutput, SeqStatus, Sequence
from .scheduler import Scheduler
from .token_ids import token_id_list


class SequenceListener(Protocol):
    """Told when a sequence finished (``finished``) or left unfinished (``release``: aborted, handed over)."""

    def finished(self, seq: Sequence) -> None: ...

    def release(self, seq_id: int) -> None: ...


class RequestBook:
    def __init__(
        self, scheduler: Scheduler, limits: RequestLimits, eos_ids: frozenset[int], listener: SequenceListener
    ) -> None:
        self.scheduler, self.limits, self.eos_ids, self.listener = scheduler, limits, eos_ids, listener
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self._next_group = 0

    def new_sequence(self, prompt_ids: Seq[int], params: SamplingParams, group: int | None) -> Sequence:
        """A sequence for a request, validated (``ValueError`` naming the problem) and numbered."""
        prompt_ids = token_id_list(prompt_ids)
        self.limits.check(prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seq = Sequence(self._next_id, list(prompt_ids), params, stop_ids, group=group)
        self._next_id += 1
        return seq

    def admit(self, seq: Sequence) -> int:
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def new_group(self) -> int:
        self._next_group += 1
        return self._next_group

    def abort(self, request_id: int) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and seq.status is not SeqStatus.FINISHED:
            self.scheduler.abort(seq)
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
            self.listener.release(seq.seq_id)

    def discard(self, request_id: int) -> None:
        self.abort(request_id)
        self.seqs.pop(request_id, None)

    def finished(self, request_id: int) -> bool:
        """Whether the request is here and has finished (its output not popped yet)."""
        seq = self.seqs.get(request_id)
        return seq is not None and seq.status is SeqStatus.FINISHED

    def release(self, request_id: int) -> PartialRequest:
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            raise ValueError(f"request {request_id} is not running here")
        partial = seq.to_partial()
        self.scheduler.abort(seq)
        self.listener.release(seq.seq_id)
        del self.seqs[request_id]
        return partial

    def finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.listener.finished(seq)

    def pop_output(self, request_id: int) -> RequestOutput:
        seq = self.seqs[request_id]
        if seq.status is not SeqStatus.FINISHED:
            raise ValueError(f"request {request_id} has not finished")  # and stays retrievable
        del self.seqs[request_id]
        return seq.to_output()
