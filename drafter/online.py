"""A drafter's online training in the trainer's process, behind one object, so that the rollout
calls it without asking what kind of drafter it has.

RL moves the policy every step; a drafter that stays put drafts worse each time. After every rollout
call :meth:`OnlineTraining.train` takes a few steps on what the rollout produced:

=====================  ==========================  ============================================
kind                   trains                      on
=====================  ==========================  ============================================
:class:`HeadTraining`  an EAGLE-3 head             the target features its drafter recorded
``DraftLMTraining``    a drafter LM's weights      the policy's completions (distilled), behind
                       (no streaming heads)        the held-out gate of ``drafter/learning.py``
``StreamingHeads...``  a drafter LM's streaming     the recent prompt + completion sequences
                       heads
``ExitAdapter...``     ``self:L``'s exit adapter   the policy's own next-token distributions
                                                   over the recent sequences
=====================  ==========================  ============================================

:func:`online_training` picks the kind; :class:`DrafterState` is what any of them keeps in a
checkpoint or sends to a Ray worker (weights, version, the trainer's step and optimizer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..draft_contract import Drafter
from .state import DrafterState, PartOptimizerHolder, TrainedPart

__all__ = ["DrafterState", "OnlineTraining", "PartOptimizerHolder", "TrainedPart", "online_training", "trained_part"]

# sequence-trained parts (streaming heads, an exit adapter): the newest prompt + completion
# sequences they train on, and their base learning rates
RECENT_SEQUENCES = 256
STREAMING_LR = 2e-3
ADAPTER_LR = 1e-3


class OnlineTraining(ABC):
    """One drafter part trained after every rollout call. The engine drafts with
    :meth:`engine_drafter`; the rollout hands over its sequences (:meth:`observe`), then calls
    :meth:`train`; :meth:`state` and :meth:`load` carry it through a checkpoint (an optimizer
    state loaded before its trainer exists waits for it)."""

    def __init__(self) -> None:
        self.trainer: PartOptimizerHolder | None = None  # made at the first need (it needs the policy)
        self._pending: DrafterState | None = None

    @property
    @abstractmethod
    def part(self) -> TrainedPart | None:
        """What training changes (None until the first engine made it)."""

    @abstractmethod
    def engine_drafter(self, policy: nn.Module, config: Any) -> Any:
        """What the engine for ``policy`` (its ``RolloutConfig``: ``config``) drafts with; binds the
        trainer to ``policy``."""

    @abstractmethod
    def observe(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> None:
        """The rollout's prompts and their completions."""

    @abstractmethod
    def train(self, steps: int, lr_scale: float) -> list[float]:
        """``steps`` steps at ``lr_scale`` x the base learning rate; the loss of each."""

    def state(self) -> DrafterState | None:
        part = self.part
        return DrafterState.of(part, self.trainer) if part is not None else None

    def load(self, state: DrafterState) -> None:
        if self.part is not None:
            state.load_into(self.part)
        self._pending = state
        if self.trainer is not None:
            self._apply_pending()

    def _apply_pending(self) -> None:
        saved, self._pending = self._pending, None
        if saved is not None:
            saved.load_trainer(self.trainer)


class HeadTraining(OnlineTraining):
    """An EAGLE-3 head, on the target features (and top-k soft labels) its drafter recorded in the
    rollouts; the buffer keeps the most recent ``buffer_bytes``."""

    def __init__(self, head: nn.Module, buffer_bytes: int, training: Any = None) -> None:
        from .eagle3 import FeatureBuffer

        super().__init__()
        self.head, self.training = head, training
        self.buffer = FeatureBuffer(buffer_bytes)

    @property
    def part(self) -> TrainedPart:
        return self.head

    def engine_drafter(self, policy: nn.Module, config: Any) -> Drafter:
        from .eagle3.train import DrafterTrainer
        from .factory import as_drafter

        embed = policy.get_input_embeddings()
        if self.trainer is None:
            self.trainer = DrafterTrainer(self.head, embed, self.buffer, self.training)
            self._apply_pending()
        else:
            self.trainer.embed = embed
        return as_drafter(self.head, policy, config, buffer=self.buffer)

    def observe(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> None:
        """Nothing to keep: the engine's drafter recorded the features while it drafted."""

    def train(self, steps: int, lr_scale: float) -> list[float]:
        self.trainer.lr_scale = lr_scale
        return [r.loss for r in self.trainer.train(steps)]


class DraftLMTraining(OnlineTraining):
    """A drafter LM's own weights (the bare LM, or a ``SmallLMDrafter`` without streaming heads), distilled on the
    policy's completions (``drafter/lm_training.py``). A copy trains; after every call it is
    compared with the drafting LM on held-out completions (every ``holdout_every``-th, never
    trained on) and replaces it only when it drafts better by more than ``min_gain`` accepted
    tokens per chain: the gate spot training on workers applies (``drafter/learning.py``)."""

    def __init__(
        self, drafter: Any, buffer_bytes: int, training: Any = None, holdout_every: int = 4, min_gain: float = 0.0
    ) -> None:
        from .learning import PartLearning, learner_for

        super().__init__()
        self.drafter, self.buffer_bytes = drafter, buffer_bytes  # a SmallLMDrafter, or the bare LM
        self.holdout_every, self.min_gain = holdout_every, min_gain
        part, learner = learner_for(drafter, None, training)
        self.learning = PartLearning(part, learner)
        self.last_held_out: tuple[float, float] | None = None  # (drafting, trained) at the last call
        self.shipped = 0  # calls whose trained copy replaced the drafting LM

    @property
    def part(self) -> TrainedPart:
        return self.learning.part

    def engine_drafter(self, policy: nn.Module, config: Any) -> Any:
        return self.drafter

    def observe(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> None:
        from .lm_training import sequence_samples

        self.learning.take(sequence_samples(prompts, completions), self.buffer_bytes, self.holdout_every)

    def train(self, steps: int, lr_scale: float) -> list[float]:
        from .learning import beats

        learning = self.learning
        if learning.trainer is None:  # from the drafting LM (and a loaded checkpoint's optimizer)
            start = DrafterState.of(self.part)
            if self._pending is not None:
                start.step, start.optimizer = self._pending.step, self._pending.optimizer
            self._pending = None
            learning.prepare(start, start, lr_scale)
            self.trainer = learning.trainer
        else:
            learning.prepare(None, None, lr_scale)
        losses = [r.loss for r in learning.train(steps)]
        self.last_held_out = learning.compare() if losses and learning.judging else None
        if losses and (self.last_held_out is None or beats(self.last_held_out, self.min_gain)):
            learning.shipped(self.part)
            self.shipped += 1
        return losses

    def state(self) -> DrafterState | None:
        """The drafting LM's weights and version, with the trainer's step and optimizer."""
        return DrafterState.of(self.part, self.trainer)

    def load(self, state: DrafterState) -> None:
        """The LM's weights now; the training copies start from them, the optimizer with them."""
        from .learning import PartLearning

        state.load_into(self.part)
        self.learning = PartLearning(self.part, self.learning.learner)
        self.trainer, self._pending = None, state


class _SequenceTraining(OnlineTraining):
    """A part trained on the recent prompt + completion sequences (at least ``minimum`` tokens)."""

    base_lr: float

    def __init__(self) -> None:
        super().__init__()
        self.recent: deque[list[int]] = deque(maxlen=RECENT_SEQUENCES)

    def observe(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> None:
        self.recent.extend(p + c for p, c in zip(prompts, completions))

    @property
    @abstractmethod
    def minimum(self) -> int: ...

    @abstractmethod
    def _make_trainer(self) -> PartOptimizerHolder: ...

    def train(self, steps: int, lr_scale: float) -> list[float]:
        if self.trainer is None:
            self.trainer = self._make_trainer()
            self._apply_pending()
        sequences = [s for s in self.recent if len(s) >= self.minimum]
        if not sequences:
            return []
        self.trainer.optimizer.param_groups[0]["lr"] = self.base_lr * lr_scale
        return self.trainer.train(sequences, steps)


class StreamingHeadsTraining(_SequenceTraining):
    """A drafter LM's streaming heads (``SmallLMDrafter(lm, streaming_heads=...)``)."""

    base_lr = STREAMING_LR

    def __init__(self, drafter: Any) -> None:
        super().__init__()
        self.drafter = drafter

    @property
    def part(self) -> TrainedPart:
        return self.drafter.heads

    @property
    def minimum(self) -> int:
        return len(self.drafter.heads) + 3

    def engine_drafter(self, policy: nn.Module, config: Any) -> Any:
        return self.drafter

    def _make_trainer(self) -> PartOptimizerHolder:
        from .streaming import StreamingHeadTrainer

        return StreamingHeadTrainer(self.drafter.model, self.drafter.heads)


class ExitAdapterTraining(_SequenceTraining):
    """``self:L``'s exit adapter of rank ``rank`` (Kangaroo), trained towards the policy's own
    next-token distributions, the policy as it is at each call being the teacher."""

    base_lr = ADAPTER_LR
    minimum = 1

    def __init__(self, layers: int, rank: int) -> None:
        super().__init__()
        self.layers, self.rank = layers, rank
        self.adapter: nn.Module | None = None  # made with the first engine (it needs the hidden size)
        self.policy: nn.Module | None = None

    @property
    def part(self) -> TrainedPart | None:
        return self.adapter

    def engine_drafter(self, policy: nn.Module, config: Any) -> Drafter:
        from .factory import as_drafter
        from .self_spec import ExitAdapter

        if self.adapter is None:
            self.adapter = ExitAdapter(policy.config.hidden_size, self.rank)
            if self._pending is not None:
                self._pending.load_into(self.adapter)
        self.policy = policy
        adapter = self.adapter.to(next(policy.parameters()).device)
        return as_drafter(f"self:{self.layers}", policy, config, adapter=adapter)

    def _make_trainer(self) -> PartOptimizerHolder:
        from .self_spec import ExitAdapterTrainer

        return ExitAdapterTrainer(self.policy, self.adapter, self.layers)

    def train(self, steps: int, lr_scale: float) -> list[float]:
        if self.trainer is not None:
            self.trainer.target = self.policy  # the teacher: the policy as it is now
        return super().train(steps, lr_scale)


def trained_part(drafter: Any) -> TrainedPart | None:
    """The part of a drafter a checkpoint keeps even when it does not train here (spot training on
    workers may train it): an EAGLE-3 head, a drafter LM's streaming heads, else its LM; else None."""
    from .eagle3 import Eagle3Head
    from .small_lm import SmallLMDrafter

    if isinstance(drafter, Eagle3Head):
        return drafter
    if isinstance(drafter, SmallLMDrafter):
        return drafter.heads if drafter.heads is not None else drafter.lm
    if isinstance(drafter, nn.Module):
        from .lm_training import versioned_lm

        return versioned_lm(drafter)
    return None


def online_training(
    drafter: Any,
    steps: int,
    buffer_bytes: int,
    adapter_rank: int | None,
    training: Any = None,
    *,
    holdout_every: int = 4,
    ship_min_gain: float = 0.0,
) -> OnlineTraining | None:
    """The online training for what a user handed the rollout as ``drafter`` with
    ``drafter_train_steps=steps``: None when nothing trains here. ``self:L`` with an
    ``adapter_rank`` drafts through its exit adapter (trained when ``steps > 0``). A drafter LM
    trains its streaming heads if it has them, else its own weights behind the held-out gate
    (``holdout_every``, ``ship_min_gain``)."""
    from .eagle3 import Eagle3Head
    from .factory import parse_self_drafter
    from .small_lm import SmallLMDrafter

    if adapter_rank is not None:
        if not isinstance(drafter, str):
            raise ValueError(f"self_adapter_rank is for drafter='self:L', got drafter={type(drafter).__name__}")
        return ExitAdapterTraining(parse_self_drafter(drafter), adapter_rank)
    if steps == 0:
        return None
    if isinstance(drafter, Eagle3Head):
        return HeadTraining(drafter, buffer_bytes, training)
    if isinstance(drafter, SmallLMDrafter) and drafter.heads is not None:
        return StreamingHeadsTraining(drafter)
    if isinstance(drafter, (SmallLMDrafter, nn.Module)):
        return DraftLMTraining(drafter, buffer_bytes, training, holdout_every, ship_min_gain)
    raise ValueError(
        "drafter_train_steps > 0 needs an EAGLE-3 head (SpecRollout(drafter=head)), a drafter LM "
        "(SpecRollout(drafter=lm) or a SmallLMDrafter) or drafter='self:L' with self_adapter_rank set"
    )
