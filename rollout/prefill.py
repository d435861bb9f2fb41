"""A prefill step's packing: the scheduled prompts' uncached tokens in one forward, the row whose
logits sample each sequence's first token, and the prompt-logprob rows asked for (one forward
scores a span: how ATTS scores a drafted chunk). A prompt group's followers share their leader's
forward: they fork its KV blocks and sample from its row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .model.attention import SequenceSlice
from .request import Sequence
from .scheduler import ScheduledBatch

# (sequence, its first kept position, packed rows of its kept tokens, its logits rows)
Observed = tuple[Sequence, int, list[int], list[int]]


@dataclass
class PrefillPack:
    slices: list[SequenceSlice] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)  # per scheduled sequence: the packed index of its last token
    scored: list[tuple[Sequence, int]] = field(default_factory=list)  # (leader, prompt tokens scored for its group)
    score_rows: list[int] = field(default_factory=list)

    @property
    def logits_index(self) -> list[int]:
        """The rows whose logits the forward returns: each sequence's last, then the scored ones."""
        return self.last + self.score_rows


def pack_prefill(batch: ScheduledBatch) -> PrefillPack:
    pack = PrefillPack()
    for seq in batch.seqs:
        new = seq.uncached_tokens()
        pack.slices.append(SequenceSlice(seq.block_table, seq.num_cached, len(new), state_slot=seq.state_slot))
        pack.positions.extend(range(seq.num_cached, seq.num_tokens))
        pack.tokens.extend(new)
        pack.last.append(len(pack.tokens) - 1)
        group = [seq, *batch.followers.get(seq.seq_id, [])]
        n = max((s.params.prompt_logprobs for s in group if s.prompt_logprobs is None), default=0)
        if n:
            # the logits at prompt position j predict token j + 1
            first = len(pack.tokens) - len(new) + (len(seq.prompt_ids) - 1 - n - seq.num_cached)
            if first < len(pack.tokens) - len(new):
                raise RuntimeError("prompt logprobs requested for a prompt that is already cached")
            pack.scored.append((seq, n))
            pack.score_rows.extend(range(first, first + n))
    return pack


def commit_prefill(
    batch: ScheduledBatch, pack: PrefillPack, fork: Callable[[Sequence, Sequence], None]
) -> tuple[list[Sequence], list[int], list[Observed]]:
    """Mark the prompts cached and fork each follower from its leader (``fork``): every sequence
    that now samples its first token, the logits row it samples from, and what a feature-reading
    drafter observes of the forward."""
    seqs, rows, observed = [], [], []
    for row, seq in enumerate(batch.seqs):
        start, end = pack.last[row] + 1 - pack.slices[row].num_new, pack.last[row] + 1
        observed.append((seq, seq.num_cached, list(range(start, end)), [row]))
        seq.num_cached = seq.num_tokens
        seqs.append(seq)
        rows.append(row)
        for member in batch.followers.get(seq.seq_id, []):
            fork(seq, member)
            observed.append((member, 0, list(range(start, end)), [row]))
            seqs.append(member)
            rows.append(row)
    return seqs, rows, observed
