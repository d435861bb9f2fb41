"""The engine's :class:`~tailspec.draft_contract.DraftStep`: a speculative step as its drafter sees it.

The drafter picks the state it drafts from by what it asks for (``Drafter.draft``):

* :meth:`EngineDraftStep.on_device`: the state the step in flight left on the device, where that
  step is a chain or tree launched there holding every sequence of this one (the host assumes it
  accepted every draft: each pending token is at most ``depth + 1`` past what the host knows), or
  the host's exact state once the step before is committed. It reserves blocks (the target's here,
  the drafter's through its ``reserve``) for a fully accepted step and bounds every position the
  step writes; a batch that gets no room or would pass ``max_model_len`` gets None.
* :meth:`EngineDraftStep.on_host`: the step before committed, a request per sequence that drafts
  (the length budget's mask, each with its depth limit); the trees the drafter returns are fitted to
  free KV blocks (:meth:`EngineDraftStep.fitted`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace

import numpy as np

from ...draft_contract import (
    EMPTY_DRAFT,
    DeviceDraftInputs,
    DraftRequest,
    DraftStep,
    DraftTree,
    static_tree_nodes,
    static_tree_scratch,
)
from ...kernels.transfers import to_device
from ..launched import Launched, committed_first
from ..model.kv_cache import blocks_for
from ..model.runner import ModelRunner
from ..request import Sequence
from ..strategy import Strategy
from .device_step import DeviceLaunch
from .kv_blocks import fit_draft, max_draft_depth
from .length_budget import drafting_mask

Reserve = Callable[[Seq[Sequence], Seq[int], bool], bool]


class EngineDraftStep(DraftStep):
    """A step of ``strategy`` over ``seqs``, launched after ``previous`` (the step in flight)."""

    def __init__(
        self,
        seqs: list[Sequence],
        strategy: Strategy,
        previous: Launched | None,
        runner: ModelRunner,
        max_model_len: int,
        length_budget: float,
    ) -> None:
        self.seqs, self.strategy, self.previous = seqs, strategy, previous
        self.shape, self.tree = strategy.shape, strategy.kind == "tree"
        self.runner, self.max_model_len, self.length_budget = runner, max_model_len, length_budget
        self.inputs: DeviceDraftInputs | None = None  # what on_device handed out
        self.commit_s = 0.0  # seconds spent committing the step before (not this step's drafting)
        self.requests: list[DraftRequest] | None = None  # what on_host handed out
        self._depths: list[int] = []  # each sequence's depth limit (0: it does not draft)

    def on_device(self, reserve: Reserve) -> DeviceDraftInputs | None:
        if self.strategy.kind not in ("chain", "tree"):
            return None
        previous, seqs = self.previous, self.seqs
        chained = previous if isinstance(previous, DeviceLaunch) and not previous.committed else None
        rows = chained.rows_of(seqs) if chained is not None else None
        if rows is None:
            chained, seqs = None, self._committed_first()
            if not seqs:
                return None
        nodes = static_tree_nodes(self.shape) if self.tree else self.shape.depth
        # each pending token's position: exact from the host, or at most depth + 1 past it (in flight)
        lengths = [s.num_cached + (chained.cache_ahead(s) if chained is not None else 0) for s in seqs]
        drafter_rows = 1 + static_tree_scratch(self.shape) if self.tree else self.shape.depth  # past each pending
        bound = max(lengths) + max(nodes + 1, drafter_rows)  # every position this step writes is below it
        if bound > self.max_model_len or not self._reserve(reserve, lengths, nodes, drafter_rows, chained is None):
            return None
        inputs = chained.next_inputs(rows) if chained is not None else self._host_inputs()
        self.inputs = replace(inputs, seqs=seqs, bound=bound)
        return self.inputs

    def on_host(self) -> list[DraftRequest]:
        if self.requests is None:
            self._committed_first()
            drafting = drafting_mask(self.seqs, self.length_budget)
            self._depths = [max_draft_depth(s, self.shape) if d else 0 for s, d in zip(self.seqs, drafting)]
            self.requests = [DraftRequest(s, n) for s, n in zip(self.seqs, self._depths) if n > 0]
        return self.requests

    def fitted(self, drafted: list[DraftTree], drafter_name: str) -> list[DraftTree]:
        """One tree per sequence from the drafter's trees for :meth:`on_host`'s requests (empty
        where it did not draft), each cut to the KV room free blocks give it."""
        if self.requests is None:
            raise RuntimeError(f"the {drafter_name} drafter returned draft trees without asking step.on_host()")
        if len(drafted) != len(self.requests):
            raise ValueError(
                f"the {drafter_name} drafter returned {len(drafted)} draft trees for {len(self.requests)} requests"
            )
        proposed = iter(drafted)
        trees = [next(proposed) if n > 0 else EMPTY_DRAFT for n in self._depths]
        cache = self.runner.cache
        return [fit_draft(s, t, cache.allocator, cache.block_size) for s, t in zip(self.seqs, trees)]

    def _committed_first(self) -> list[Sequence]:
        """The step before committed: the sequences still running, timed apart from the drafting."""
        start = time.perf_counter()
        self.seqs = committed_first(self.seqs, self.previous)
        self.commit_s += time.perf_counter() - start
        return self.seqs

    def _reserve(self, reserve: Reserve, lengths: list[int], nodes: int, drafter_rows: int, from_host: bool) -> bool:
        """Blocks for each sequence's fully accepted step (its pending token at ``lengths[i]``, then
        ``nodes`` drafts) in the target's cache, and for the drafter's ``drafter_rows`` past the
        pending token in its own; False, taking none of the target's, where either has no room."""
        bs, allocator = self.runner.cache.block_size, self.runner.cache.allocator
        missing = [blocks_for(n + nodes + 1, bs) - len(s.block_table) for s, n in zip(self.seqs, lengths)]
        if sum(m for m in missing if m > 0) > allocator.num_free:
            return False
        if not reserve(self.seqs, [n + drafter_rows for n in lengths], from_host):
            return False
        for seq, m in zip(self.seqs, missing):
            if m > 0:
                seq.block_table += allocator.allocate(m)
        return True

    def _host_inputs(self) -> DeviceDraftInputs:
        """What a step launched from the host's state drafts from (exact: nothing is in flight)."""
        seqs, device = self.seqs, self.runner.device
        cached = to_device(np.asarray([s.num_cached for s in seqs], dtype=np.int64), device)
        two = [[s.token_at(s.num_cached - 1), s.token_at(s.num_cached)] for s in seqs]
        return DeviceDraftInputs(cached, to_device(np.asarray(two, dtype=np.int64), device))
