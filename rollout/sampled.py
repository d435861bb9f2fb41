"""Tokens sampled on the device and not yet read: what a plain step hands back before its host
half, and what overlapped decoding (``RolloutConfig.overlap``) keeps in flight across a step.

Overlapped, step N + 1 is launched before step N's tokens are read, so the host's part of a step
(scheduling, the next forward's inputs, appending tokens and checking stops) runs while the device
computes, as SGLang's overlap scheduler and vLLM's async scheduling do for plain decoding:

* a sequence's next input is its last sampled token, still on the device: the tensor of step N's
  tokens feeds step N + 1's forward (:meth:`Sampled.inputs_for`) and is read only for the host;
* a sequence that emitted a stop token in step N has a row in step N + 1 already: it is computed
  and dropped, its K/V written to its own blocks, which are freed after. The device runs the
  writes in order, so whichever sequence gets those blocks next writes after them. A sequence
  whose final token (``max_new_tokens``) is in flight takes no further step;
* such a dropped row of an unseeded sampled request drew a uniform from the engine's generator,
  so the rows after it get other draws from the same distribution. Greedy, seeded and
  position-keyed requests decode the same tokens with and without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.transfers import QueuedRead, select_rows
from .request import Sequence


@dataclass
class Sampled:
    """One forward's sampled tokens: ``tokens`` on the device, and the read that brings them and
    their logprobs to the host (queued when sampled, waited for by :meth:`read`)."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [len(seqs)] on the logits' device
    pending: QueuedRead  # tokens, then logprobs

    def read(self) -> list[list]:
        """``[tokens, logprobs]`` on the host (waits for them)."""
        return self.pending.result()

    def inputs_for(self, seqs: list[Sequence]) -> torch.Tensor:
        """The tokens sampled here for ``seqs`` (each one of this step's), in their order, on the
        device: the next decode step's inputs, never read for it."""
        row_of = {id(seq): row for row, seq in enumerate(self.seqs)}
        missing = [seq.seq_id for seq in seqs if id(seq) not in row_of]
        if missing:
            raise RuntimeError(f"sequences {missing} have no token in flight (overlapped decoding bug)")
        rows = [row_of[id(seq)] for seq in seqs]
        if rows == list(range(len(self.seqs))):
            return self.tokens
        return select_rows(self.tokens, rows)
