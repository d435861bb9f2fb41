"""Continuous batching: which sequences run in the next forward, and with which KV blocks.

Each step is either a *prefill* (admit waiting sequences while KV blocks last, compute their
uncached tokens) or a *decode* (one new token for every running sequence). When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed (prompt and
everything it generated so far) when blocks are free again. A fresh prompt group (the same
prompt submitted several times) is admitted together and prefilled once: its members share the
leader's full blocks and get a private copy of the last partial block.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from .launched import Launched, committed_first
from .model.kv_cache import BlockAllocator, blocks_for, prefix_hashes
from .model.recurrent_state import RecurrentStates
from .request import SeqStatus, Sequence


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # running sequences' next token + newly admitted prompts in one forward


@dataclass
class ScheduledBatch:
    kind: StepKind
    seqs: list[Sequence]
    # leader seq_id -> members that reuse the leader's prefill (their blocks are already set up)
    followers: dict[int, list[Sequence]] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_prefill_tokens: int,
        states: RecurrentStates | None = None,
    ) -> None:
        self.allocator = allocator
        self.states = states  # a recurrent model's: a slot per running sequence
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self._in_flight: Launched | None = None  # the step in flight while a step is scheduled

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- step planning -------------------------------------------------------------------
    def schedule(self, mixed: bool = False, in_flight: Launched | None = None) -> ScheduledBatch | None:
        """A prefill step if a waiting sequence can be admitted, else a decode step. With ``mixed``,
        the running sequences' blocks for their next token are reserved first and any admitted
        prompts join them in one MIXED step (running sequences first in ``seqs``, the step in
        flight committed: their pending tokens are the host's). ``in_flight``: the step launched
        and not committed, committed before anyone is preempted (its tokens are kept, and the
        blocks freed hold K/V of known tokens)."""
        self._in_flight = in_flight
        try:
            if not mixed or not self.running:
                return self._schedule_prefill() or self._schedule_decode()
            decode = self._schedule_decode()
            prefill = self._schedule_prefill()
            if decode is None or prefill is None:
                return decode or prefill
            running = committed_first(decode.seqs, in_flight)
            return ScheduledBatch(StepKind.MIXED, running + prefill.seqs, prefill.followers)
        finally:
            self._in_flight = None  # held for this call only

    def _group_members(self, leader: Sequence) -> list[Sequence]:
        if leader.group is None or not leader.is_fresh:
            return []
        return [s for s in self.waiting if s is not leader and s.group == leader.group and s.is_fresh]

    def _schedule_prefill(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        followers: dict[int, list[Sequence]] = {}
        num_tokens = 0
        while self.waiting:
            slots_left = self.max_num_seqs - len(self.running)
            if slots_left <= 0:
                break
            seq = self.waiting[0]
            group = self._group_members(seq)
            cached = self._cached_prefix(seq, group)
            new_tokens = seq.num_tokens - seq.num_cached - len(cached) * self.block_size
            if admitted and num_tokens + new_tokens > self.max_prefill_tokens:
                break
            own_blocks = blocks_for(seq.num_tokens, self.block_size) - len(cached)
            revived = sum(self.allocator.refcount(b) == 0 for b in cached)  # leave the evictable pool
            if own_blocks + revived + self._decode_headroom() > self.allocator.num_free:
                break
            members = group[: slots_left - 1]
            partial = seq.num_tokens % self.block_size != 0
            if partial:  # each member needs its own copy of the last block
                members = members[: self.allocator.num_free - own_blocks]
            self.waiting.popleft()
            for b in cached:
                self.allocator.reuse(b)
            seq.block_table = cached + self.allocator.allocate(own_blocks)
            seq.num_cached += len(cached) * self.block_size
            self.num_prefix_hit_tokens += len(cached) * self.block_size
            self._start(seq)
            admitted.append(seq)
            num_tokens += new_tokens
            if members:
                full = seq.block_table[:-1] if partial else seq.block_table
                for m in members:
                    self.waiting.remove(m)
                    m.block_table = self.allocator.share(full) + (self.allocator.allocate(1) if partial else [])
                    self._start(m)
                followers[seq.seq_id] = members
        if not admitted:
            return None
        return ScheduledBatch(StepKind.PREFILL, admitted, followers)

    def _cached_prefix(self, seq: Sequence, group: list[Sequence]) -> list[int]:
        """Cached blocks holding the start of a sequence that has nothing in the cache yet. At
        least one token is left to compute (its logits), and the prompt span whose
        log-probabilities were asked for and not yet computed stays uncached."""
        if not self.allocator.cache_prefixes or seq.num_cached or seq.block_table:
            return []
        limit = seq.num_tokens - 1
        spans = [s.params.prompt_logprobs for s in (seq, *group) if s.prompt_logprobs is None]
        if any(spans):
            limit = min(limit, len(seq.prompt_ids) - 1 - max(spans))
        tokens = seq.prompt_ids + seq.output_ids
        blocks = []
        for h in prefix_hashes(tokens, self.block_size, max(0, limit) // self.block_size):
            block = self.allocator.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _register_prefix(self, seq: Sequence) -> None:
        """Name the full blocks whose K/V the sequence has computed, for later requests."""
        full = min(seq.num_cached // self.block_size, len(seq.block_table))
        if not self.allocator.cache_prefixes or full == 0 or seq.cache_epoch != self.allocator.epoch:
            return  # nothing full, or (part of) its K/V was computed with weights since replaced
        for block, h in zip(seq.block_table, prefix_hashes(seq.prompt_ids + seq.output_ids, self.block_size, full)):
            self.allocator.register(block, h)

    def _decode_headroom(self) -> int:
        """Blocks the running sequences need for their next token; admission leaves them free
        so that admitting a sequence does not immediately force a preemption."""
        return sum(1 for s in self.running.values() if s.num_cached + 1 > len(s.block_table) * self.block_size)

    def decode_fits(self) -> bool:
        """The running sequences' next decode step needs no preemption (its blocks are free)."""
        return self._decode_headroom() <= self.allocator.num_free

    def _start(self, seq: Sequence) -> None:
        if self.states is not None:
            seq.state_slot = self.states.allocate()
        seq.cache_epoch = self.allocator.epoch
        seq.status = SeqStatus.RUNNING
        self.running[seq.seq_id] = seq

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        in_flight = self._in_flight
        final = in_flight.holds_final if in_flight is not None else _never
        for seq in list(self.running.values()):
            if seq.status is not SeqStatus.RUNNING or final(seq):
                continue  # preempted or finished earlier in this loop, or its final token is being read
            if self._reserve(seq):
                scheduled.append(seq)
        scheduled = [s for s in scheduled if s.status is SeqStatus.RUNNING]
        if not scheduled:
            return None
        return ScheduledBatch(StepKind.DECODE, scheduled)

    def _reserve(self, seq: Sequence) -> bool:
        """Grow ``seq``'s block table for its next decode step, past the tokens the step in flight
        may still add, preempting others if needed; False if ``seq`` itself was preempted or
        finished. The step in flight is committed before anyone is preempted (what it finished
        frees blocks, and it adds no more)."""
        missing = self._missing(seq)
        if missing <= 0:
            return True
        while missing > self.allocator.num_free:
            in_flight = self._in_flight
            if in_flight is not None and not in_flight.committed:
                in_flight.commit()
                if seq.status is not SeqStatus.RUNNING:
                    return False
            else:
                victim = self.running[next(reversed(self.running))]
                self.preempt(victim)
                if victim is seq:
                    return False
            missing = self._missing(seq)
        if missing > 0:
            seq.block_table += self.allocator.allocate(missing)
        return True

    def _missing(self, seq: Sequence) -> int:
        ahead = self._in_flight.cache_ahead(seq) if self._in_flight is not None else 0
        return blocks_for(seq.num_cached + ahead + 1, self.block_size) - len(seq.block_table)

    # -- state changes -------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_cached = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def abort(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED
        elif seq.status is SeqStatus.RUNNING:
            self.finish(seq)

    def _release(self, seq: Sequence) -> None:
        self.running.pop(seq.seq_id, None)
        if seq.state_slot:
            self.states.free(seq.state_slot)
            seq.state_slot = 0
        if seq.block_table:
            self._register_prefix(seq)
            self.allocator.free(seq.block_table)
            seq.block_table = []


def _never(seq: Sequence) -> bool:
    return False
