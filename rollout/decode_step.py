"""The engine's speculative decode step, as gpt-fast reads it: drafts -> target forward -> verify ->
accept -> commit (the four functions of ``rollout/spec/step.py``); each sequence advances by its own
accepted length. Why the output is exactly the target's: ``rollout/spec/verify.py``.

The drafts come from one of two sources behind :meth:`SpeculativeStep._drafts`: serially from the
engine's drafters (chain, tree, suffix, hybrid; on the running mirror pipeline's drafter where one
runs, ``MirrorSlot.serial_drafts``), or from the mirror pipeline, which drafts the next round's
beside the verification forward (``rollout/mirror/pipeline.py``). Which strategy a step runs is
``StrategyChoice``'s; this module runs the step it is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..draft_contract import Drafter, DraftTree
from .adaptive.acceptance import first_branch
from .feature_taps import FeatureTaps
from .mirror.pipeline import MirrorPipeline
from .mirror.slot import MirrorSlot
from .model.runner import Forward, ModelRunner
from .params import RolloutConfig
from .request import Sequence
from .spec.kv_blocks import pack_verify_batch, release_unused_blocks
from .spec.length_budget import drafting_mask
from .spec.step import accept, commit, propose, verify
from .stats import EngineStats
from .strategy import Strategy


@dataclass(frozen=True)
class Speculated:
    """A speculative step's result: the sequences that are done (for the engine to finish), and
    per sequence the draft tokens verified and how many were accepted (what ``adaptive`` learns)."""

    done: list[Sequence]
    drafted: list[int]
    accepted: list[int]
    branches: list[tuple[int, int]]  # per sequence: its tree's first branch's depth, and how much of it was kept


class SpeculativeStep:
    def __init__(
        self,
        runner: ModelRunner,
        config: RolloutConfig,
        drafter_for: Callable[[Strategy], Drafter],
        mirrors: MirrorSlot,
        taps: FeatureTaps,
        forward: Forward,
        generator: torch.Generator,
        stats: EngineStats,
    ) -> None:
        self.runner, self.config, self.drafter_for, self.mirrors = runner, config, drafter_for, mirrors
        self.taps, self.forward, self.generator, self.stats = taps, forward, generator, stats

    def __call__(self, seqs: list[Sequence], strategy: Strategy) -> Speculated:
        """Run one step of ``strategy`` over ``seqs``."""
        allocator, bs = self.runner.cache.allocator, self.config.block_size
        strategy, mirror = self.mirrors.for_step(strategy)
        start = time.perf_counter()
        drafting = drafting_mask(seqs, self.config.length_budget)
        trees, drafter = self._drafts(strategy, mirror, seqs, drafting)
        drafted_at = time.perf_counter()
        slices, tokens, positions = pack_verify_batch(seqs, trees)
        bases = [seq.num_tokens for seq in seqs]
        with self.mirrors.beside(mirror, self.runner, seqs, trees, strategy):
            logits = self.forward(slices, tokens, positions, list(range(len(tokens))))
        verified = verify(seqs, trees, logits, [s.num_new for s in slices], self.generator)
        committed = commit(seqs, trees, verified, accept(trees, verified), self.runner.cache)
        self.stats.generated_tokens += committed.emitted
        if mirror is not None:
            mirror.settle(seqs, trees, verified.verdicts, strategy, bases)
        self.taps.observe(committed.observed, logits)  # before finishing: a recording drafter needs every feature
        for seq, verdict in zip(seqs, verified.verdicts):
            if mirror is None:
                drafter.accepted(seq, len(verdict.path))
            if not seq.done:
                release_unused_blocks(seq, allocator, bs)
        draft_s, verify_s = drafted_at - start, time.perf_counter() - drafted_at
        self.stats.record_spec_step(
            str(strategy), len(seqs), committed.drafted, committed.accepted, committed.emitted, draft_s, verify_s
        )
        done = [seq for seq in seqs if seq.done]
        paths = [v.path for v in verified.verdicts]
        branches = [first_branch(t, p) for t, p in zip(trees, paths)]
        return Speculated(done, [len(t) for t in trees], [len(p) for p in paths], branches)

    def _drafts(
        self, strategy: Strategy, mirror: MirrorPipeline | None, seqs: list[Sequence], drafting: list[bool]
    ) -> tuple[list[DraftTree], Drafter]:
        """A step's drafts and the drafter that made them."""
        allocator, bs = self.runner.cache.allocator, self.config.block_size
        if mirror is not None:
            return mirror.drafts(seqs, strategy, allocator, bs, drafting), mirror.drafter
        shared = self.mirrors.serial_drafts(strategy, seqs, allocator, bs, drafting)
        if shared is not None:
            return shared
        drafter = self.drafter_for(strategy)
        return propose(drafter, seqs, strategy.shape, allocator, bs, drafting), drafter
