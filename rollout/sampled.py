"""A plain step launched: one token per sequence sampled on the device, read at its commit.

The loop launches step N + 1 before step N is committed, so the host's part of a step (scheduling,
the next forward's inputs, appending tokens and checking stops) runs while the device computes, as
SGLang's overlap scheduler and vLLM's async scheduling do for plain decoding:

* a sequence's next input is its last sampled token, still on the device: the tensor of step N's
  tokens feeds step N + 1's forward (:meth:`Sampled.inputs_for`) and is read only for the host;
* a sequence that emitted a stop token in step N has a row in step N + 1 already: it is computed
  and dropped, its K/V written to its own blocks, which are freed after. The device runs the
  writes in order, so whichever sequence gets those blocks next writes after them. A sequence
  whose final token (``max_new_tokens``) is in flight takes no further step;
* such a dropped row of an unseeded sampled request drew a uniform from the engine's generator,
  so the rows after it get other draws from the same distribution. Greedy, seeded and
  position-keyed requests decode the same tokens whatever is in flight.

On a CPU the device is the host: the forward runs inside the launch, and the order changes only
when the host's bookkeeping runs, not what overlaps it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.transfers import QueuedRead, select_rows
from .launched import Committed, Launched
from .request import SeqStatus, Sequence
from .stats import EngineStats


class Sampled(Launched):
    """One forward's sampled tokens: ``tokens`` on the device, and the read that brings them and
    their logprobs to the host (queued when sampled, waited for at the commit)."""

    def __init__(
        self,
        seqs: list[Sequence],
        tokens: torch.Tensor,
        pending: QueuedRead,
        finish: Callable[[Sequence], None],
        stats: EngineStats,
    ) -> None:
        super().__init__(seqs, stats)
        self.tokens = tokens  # [len(seqs)] on the logits' device
        self.pending: QueuedRead | None = pending  # tokens, then logprobs
        self.finish = finish

    def _commit(self) -> Committed:
        """Append the sampled tokens; a row of a request that finished, was aborted or handed over
        meanwhile is dropped."""
        tokens, logprobs = self.pending.result()
        finished, emitted = [], 0
        for seq, token, logprob in zip(self.seqs, tokens, logprobs):
            if seq.status is SeqStatus.FINISHED:
                self.stats.dropped_rows += 1
                continue
            seq.append(token, logprob)
            emitted += 1
            if seq.done:
                self.finish(seq)
                finished.append(seq.seq_id)
        self.stats.generated_tokens += emitted
        self.pending = None  # read: nothing of it is needed again
        return Committed(finished, emitted)

    def unread(self, seq: Sequence) -> int:
        """Tokens sampled here for ``seq`` that its ``output_ids`` do not hold yet."""
        return int(not self.committed and self.holds(seq))

    def holds_final(self, seq: Sequence) -> bool:
        return len(seq.output_ids) + 1 >= seq.params.max_new_tokens and self.unread(seq) > 0

    def inputs_for(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The tokens sampled here for ``seqs``, in their order, on the device: the next plain step's
        inputs, never read for it. None once committed, or where one of ``seqs`` is not here."""
        rows = None if self.committed else self.rows_of(seqs)
        if rows is None:
            return None
        return self.tokens if rows == list(range(len(self.seqs))) else select_rows(self.tokens, rows)
