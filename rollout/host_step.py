"""A speculative step whose drafts come from the host: the suffix and hybrid drafters (which draft from
text), the mirror pipeline (whose branches are settled against the emitted text), and a chain or
tree whose batch cannot be launched from the device's state (no room for a fully accepted step, or
a drafter that does not draft on the device).

Its drafter reads every token, so the step's launch commits the step before it first, then
proposes, runs the target and verifies (one read: the verdicts), and commits itself before the
launch returns: the step after it starts from the host's exact state. The cost, against a step
launched from the device's state: the device idles while the host drafts, verifies and commits.
The four stages are ``spec/step.py``'s functions; why the output is exactly the target's:
``spec/verify.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .feature_taps import FeatureTaps
from .launched import Committed, Launched
from .model.kv_cache import PagedKVCache
from .model.recurrent_state import RecurrentStates
from .proposer import Proposal
from .request import Sequence
from .spec.kv_blocks import release_unused_blocks
from .spec.step import Verified, accept, commit
from .stats import Drafted, EngineStats


class HostVerified(Launched):
    """A step drafted, run and verified: its commit keeps the accepted K/V and tokens, frees the
    rejected drafts' blocks, hands a feature-reading drafter the kept tokens' features and finishes
    the requests that stopped."""

    def __init__(
        self,
        seqs: list[Sequence],
        proposal: Proposal,
        verified: Verified,
        logits: torch.Tensor,
        seconds: tuple[float, float, float],  # drafting, the target's forward, verifying
        cache: PagedKVCache,
        states: RecurrentStates | None,
        taps: FeatureTaps,
        stats: EngineStats,
        finish: Callable[[Sequence], None],
    ) -> None:
        super().__init__(seqs, stats)
        self.proposal: Proposal | None = proposal
        self.verified: Verified | None = verified
        self.logits: torch.Tensor | None = logits
        self.draft_s, self.forward_s, self.verify_s = seconds
        self.cache, self.states, self.taps, self.finish = cache, states, taps, finish
        self.bases = [seq.num_tokens for seq in seqs]

    def _commit(self) -> Committed:
        start, seqs, trees, verified = time.perf_counter(), self.seqs, self.proposal.trees, self.verified
        kept = commit(seqs, trees, verified, accept(trees, verified), self.cache)
        if self.states is not None:  # each sequence's state after the last token it kept
            last = [v.path[-1] + 1 if v.path else 0 for v in verified.verdicts]
            self.states.keep(torch.tensor([s.state_slot for s in seqs]), torch.tensor(last))
        self.stats.generated_tokens += kept.emitted
        self.proposal.verified(seqs, verified.verdicts, self.bases)
        self.taps.observe(kept.observed, self.logits)  # before finishing: a recording drafter needs every feature
        for seq in seqs:
            if not seq.done:
                release_unused_blocks(seq, self.cache.allocator, self.cache.block_size)
        verify_s = self.verify_s + time.perf_counter() - start
        strategy = str(self.proposal.strategy)
        self.stats.record_spec_step(
            strategy, len(seqs), kept.drafted, kept.accepted, kept.emitted, self.draft_s, verify_s
        )
        finished = [seq for seq in seqs if seq.done]
        for seq in finished:
            self.finish(seq)
        paths = [v.path for v in verified.verdicts]
        branches = [t.first_branch(p) for t, p in zip(trees, paths)]
        drafted = Drafted([len(t) for t in trees], [len(p) for p in paths], branches)
        self.proposal = self.verified = self.logits = None  # the loop holds the record a step longer
        return Committed([seq.seq_id for seq in finished], kept.emitted, drafted)
