"""Where a decode step's drafts come from: nowhere (plain decoding: every draft empty), the engine's
drafters (chain, tree, suffix, hybrid), or the mirror pipeline, which drafts the next round beside
the verification forward (``rollout/mirror/``).

A step asks :meth:`Proposer.propose` for a :class:`Proposal` and runs it the same way whatever its
source: the proposal's :meth:`~Proposal.around_forward` wraps the target forward (the mirror's
drafting runs beside it) and :meth:`~Proposal.verified` hands it the verdicts (the mirror keeps
the branches they agree with; a serial drafter learns how much of its draft was kept). The step
never asks which source it got. The proposer is also what the request book tells about finished
and released sequences, and what the feature taps hand the target's features to.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..draft_contract import EMPTY_DRAFT, Drafter, DrafterSet, DraftTree
from .mirror.executors import DraftExecutor
from .mirror.pipeline import MirrorPipeline
from .mirror.slot import MirrorSlot
from .model.runner import ModelRunner
from .params import RolloutConfig
from .request import Sequence
from .spec.length_budget import drafting_mask
from .spec.step import propose
from .spec.verify import Verdict
from .strategy import Strategy


@dataclass
class Proposal:
    """A step's drafts (one tree per sequence, empty where it does not draft), the strategy they
    were drafted for (a failed mirror pipeline's step falls back to its serial strategy), and the
    drafter that made them; ``mirror`` when the mirror pipeline did."""

    strategy: Strategy
    trees: list[DraftTree]
    drafter: Drafter | None = None
    mirror: MirrorPipeline | None = None

    @property
    def plain(self) -> bool:
        """Every draft empty by strategy: one token a sequence, sampled, nothing to verify."""
        return self.drafter is None

    @contextmanager
    def around_forward(self, runner: ModelRunner, seqs: Seq[Sequence]) -> Iterator[None]:
        """The verification forward, with a mirror step's drafting beside it (nothing otherwise);
        eager when an early-exit hook must fire (a graph replay skips hooks)."""
        if self.mirror is None:
            yield
            return
        eager = runner.eager() if self.strategy.branches else nullcontext()
        with self.mirror.overlap(seqs, self.trees, self.strategy), eager:
            yield

    def verified(self, seqs: Seq[Sequence], verdicts: Seq[Verdict], bases: Seq[int]) -> None:
        """What the verification kept of each draft (``bases``: each sequence's tokens before it)."""
        if self.mirror is not None:
            self.mirror.settle(seqs, self.trees, verdicts, self.strategy, bases)
            return
        for seq, verdict in zip(seqs, verdicts):
            self.drafter.accepted(seq, len(verdict.path))


class Proposer:
    def __init__(self, model: torch.nn.Module, drafters: DrafterSet, config: RolloutConfig) -> None:
        self.config = config
        self.drafter, self.suffix, self.hybrid = drafters.model, drafters.suffix, drafters.hybrid
        self.mirrors = MirrorSlot(model, self.drafter, config.mirror, config.kernels)
        self._notified = [d for d in (self.drafter, self.suffix) if d is not None]  # of finished sequences

    def propose(self, seqs: list[Sequence], strategy: Strategy, allocator, block_size: int) -> Proposal:
        """``seqs``' drafts for a step of ``strategy``, within their limits and free KV blocks."""
        if not strategy.speculative:
            return Proposal(strategy, [EMPTY_DRAFT] * len(seqs))
        strategy, mirror = self.mirrors.for_step(strategy)
        drafting = drafting_mask(seqs, self.config.length_budget)
        if mirror is not None:
            trees = mirror.drafts(seqs, strategy, allocator, block_size, drafting)
            return Proposal(strategy, trees, mirror.drafter, mirror)
        shared = self.mirrors.serial_drafts(strategy, seqs, allocator, block_size, drafting)
        if shared is not None:
            return Proposal(strategy, *shared)
        drafter = self.drafter_for(strategy)
        return Proposal(strategy, propose(drafter, seqs, strategy.shape, allocator, block_size, drafting), drafter)

    def before_step(self, strategy: Strategy) -> None:
        """Every decode step: with ``MirrorConfig.threads``, a mirror step leaves the draft its threads."""
        self.mirrors.split_threads(strategy)

    def drafts_on_host(self, strategy: Strategy) -> bool:
        """Whether a step of ``strategy`` drafts here, from the host's text, even with a drafter that
        drafts on the device: while a mirror pipeline runs, chains and trees draft on its drafter."""
        return self.mirrors.pipeline is not None and strategy.kind in ("chain", "tree")

    def drafter_for(self, strategy: Strategy) -> Drafter:
        if strategy.kind == "suffix":
            return self.suffix
        return self.hybrid if strategy.kind == "hybrid" else self.drafter

    # -- what the request book and the feature taps tell it ---------------------------------
    def finished(self, seq: Sequence) -> None:
        for drafter in self._notified:
            drafter.finished(seq)
        self.release(seq.seq_id)

    def release(self, seq_id: int) -> None:
        """A sequence finished, was aborted or handed over: its drafting state goes."""
        for drafter in self._notified:
            drafter.release(seq_id)
        self.mirrors.release(seq_id)

    def observe(self, observed, features: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's features of kept tokens, for the drafter and a copy of it in a draft process."""
        self.drafter.observe_batch(observed, features, logits)
        self.mirrors.observe(observed, features, logits)

    # -- the mirror pipeline's life ----------------------------------------------------------
    @property
    def mirror(self) -> MirrorPipeline | None:
        return self.mirrors.pipeline

    def prepare(self, arms: list[Strategy]) -> None:
        """Refuse arms this engine cannot run, and start what they need now, not inside a measured step."""
        self.mirrors.prepare(arms)

    def use_executor(self, executor: DraftExecutor | None) -> None:
        self.mirrors.use_executor(executor)

    def between_steps(self, alive: list[int], hostable: bool) -> None:
        """Take the draft executor asked for since the last step (:meth:`use_executor`)."""
        self.mirrors.switch_between_steps(alive, hostable)

    @property
    def switch_pending(self) -> bool:
        return self.mirrors.switch_pending

    def hostable(self, arms: list[Strategy], reads_features: bool) -> bool:
        return self.mirrors.hostable(arms, reads_features)

    def close(self) -> None:
        self.mirrors.close()
