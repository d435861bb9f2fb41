"""The engine's drafters as one party: the :class:`DrafterSet` names the drafter of each step's
strategy; the request book tells them of finished and released sequences, the feature taps hand them
the target's features, and :meth:`Proposer.prepare` tells them the arms they may run.

A step drafted from the host's text is verified as a :class:`Proposal` the same way whatever drafted
it: :meth:`~Proposal.around_forward` wraps the target forward and :meth:`~Proposal.verified` hands
the drafter the verdicts. A drafter that runs whole steps (:class:`DraftsWholeSteps`: Mirror-SD drafts
the next round beside the forward) does both itself; any other drafter learns how much of its draft
was kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..draft_contract import Drafter, DrafterSet, DraftTree, Settled, runs_whole_steps
from .model.runner import ModelRunner
from .params import RolloutConfig
from .request import Sequence
from .spec.verify import Verdict
from .strategy import Strategy


@dataclass
class Proposal:
    """A step's drafts (one tree per sequence, empty where it does not draft), the strategy they
    were drafted for (a drafter that cannot run the step's strategy falls back to another), and the
    drafter that made them (None: plain decoding)."""

    strategy: Strategy
    trees: list[DraftTree]
    drafter: Drafter | None = None

    @property
    def plain(self) -> bool:
        """Every draft empty by strategy: one token a sequence, sampled, nothing to verify."""
        return self.drafter is None

    @contextmanager
    def around_forward(self, runner: ModelRunner, seqs: Seq[Sequence]) -> Iterator[None]:
        """The verification forward, with what a whole-step drafter runs beside it; eager when the
        strategy's early exit must fire (a graph replay skips hooks)."""
        if not runs_whole_steps(type(self.drafter)):
            yield
            return
        eager = runner.eager() if self.strategy.branches else nullcontext()
        with self.drafter.beside_verify(seqs, self.trees, self.strategy), eager:
            yield

    def verified(self, seqs: Seq[Sequence], verdicts: Seq[Verdict], bases: Seq[int]) -> None:
        """What the verification kept of each draft (``bases``: each sequence's tokens before it)."""
        if runs_whole_steps(type(self.drafter)):
            self.drafter.settle(seqs, self.trees, verdicts, self.strategy, bases)
            return
        for seq, verdict in zip(seqs, verdicts):
            self.drafter.settled(seq, Settled(len(verdict.path)))


class Proposer:
    def __init__(self, drafters: DrafterSet, config: RolloutConfig) -> None:
        self.config, self.drafters = config, drafters
        self._notified = drafters.notified()  # of finished and released sequences

    def before_step(self, strategy: Strategy) -> None:
        """Every decode step: with ``MirrorConfig.threads``, a mirror step leaves the draft its
        ``draft_threads`` and any other step gives the target all of them."""
        mirror = self.config.mirror
        if mirror is not None and mirror.threads is not None:
            torch.set_num_threads(mirror.threads - (mirror.draft_threads if strategy.mirror else 0))

    def prepare(self, arms: list[Strategy]) -> None:
        """Refuse arms this engine cannot run, and start what they need now, not inside a measured step."""
        if self.drafters.mirror is not None:
            self.drafters.mirror.prepare(arms)

    # -- what the request book and the feature taps tell it ---------------------------------
    def finished(self, seq: Sequence) -> None:
        for drafter in self._notified:
            drafter.finished(seq)
        self.release(seq.seq_id)

    def release(self, seq_id: int) -> None:
        """A sequence finished, was aborted or handed over: its drafting state goes."""
        for drafter in self._notified:
            drafter.release(seq_id)

    def observe(self, observed, features: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's features of kept tokens, for the drafter and any copy of it elsewhere."""
        self.drafters.model.observe_batch(observed, features, logits)
        if self.drafters.mirror is not None:
            self.drafters.mirror.observe_batch(observed, features, logits)

    def close(self) -> None:
        if self.drafters.mirror is not None:
            self.drafters.mirror.close()
