"""A drafter's online training in the trainer's process, behind one object, so that the rollout
calls it without asking what kind of drafter it has.

RL moves the policy every step; a drafter that stays put drafts worse each time. After every rollout
call :meth:`OnlineTraining.train` takes a few steps on what the rollout produced:

========================  ===========================  ==========================================
kind                      trains                       on
========================  ===========================  ==========================================
:class:`HeadTraining`     an EAGLE-3 head (in place)   the target features its drafter recorded
:class:`DraftLMTraining`  a drafter LM's weights, or   the policy's completions, a copy shipped
                          its streaming heads          only when it wins on held-out ones
:class:`ExitAdapter...`   ``self:L``'s exit adapter    the same, towards the policy's own
                                                       next-token distributions
========================  ===========================  ==========================================

The last two are :class:`GatedTraining`: the learning path and held-out gate of
``drafter/part_learning.py`` that spot training on Ray workers runs too. :func:`online_training` picks
the kind; :class:`DrafterState` is what any of them keeps in a checkpoint or sends to a Ray worker
(weights, version, the trainer's step and optimizer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..draft_contract import Drafter
from .lm_trainer import sequence_samples
from .part_learning import Learner, PartLearning, beats, check_training_config, learner_for
from .state import DrafterState, PartOptimizerHolder, TrainedPart

__all__ = ["DrafterState", "OnlineTraining", "PartOptimizerHolder", "TrainedPart", "online_training", "trained_part"]


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


class GatedTraining(OnlineTraining):
    """A part trained on the policy's completions as spot training trains it
    (:class:`~tailspec.drafter.part_learning.PartLearning`): a copy trains; after every call it is
    compared with the drafting part on held-out completions (every ``holdout_every``-th, never
    trained on) and replaces it only when it drafts better by more than ``min_gain`` accepted
    tokens per chain. A subclass sets :attr:`learning` (at once, or with its first engine)."""

    def __init__(self, buffer_bytes: int, holdout_every: int = 4, min_gain: float = 0.0) -> None:
        super().__init__()
        self.buffer_bytes, self.holdout_every, self.min_gain = buffer_bytes, holdout_every, min_gain
        self.learning: PartLearning | None = None
        self.last_held_out: tuple[float, float] | None = None  # (drafting, trained) at the last call
        self.shipped = 0  # calls whose trained copy replaced the drafting part

    @property
    def part(self) -> TrainedPart | None:
        return self.learning.part if self.learning is not None else None

    def _learn(self, part: TrainedPart, learner: Learner) -> None:
        """Learn ``part`` with ``learner``; a checkpoint loaded before the part existed goes into it."""
        self.learning = PartLearning(part, learner)
        if self._pending is not None:
            self._pending.load_into(part)

    def observe(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> None:
        self.learning.take(sequence_samples(prompts, completions), self.buffer_bytes, self.holdout_every)

    def train(self, steps: int, lr_scale: float) -> list[float]:
        learning = self.learning
        if learning.trainer is None:  # from the drafting part (and a loaded checkpoint's optimizer)
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
        """The drafting part's weights and version, with the trainer's step and optimizer."""
        part = self.part
        if part is None:  # not made yet: what was loaded, unchanged
            return self._pending
        return DrafterState.of(part, self.trainer)

    def load(self, state: DrafterState) -> None:
        """The part's weights now (or when it is made); the training copies start from them, the
        optimizer with them."""
        self.trainer, self._pending = None, state
        if self.learning is not None:
            state.load_into(self.part)
            self.learning = PartLearning(self.part, self.learning.learner)


class DraftLMTraining(GatedTraining):
    """A drafter LM's streaming heads if it has them (``SmallLMDrafter(lm, streaming_heads=...)``),
    else its own weights (the bare LM, or a ``SmallLMDrafter``), distilled on the policy's
    completions (``drafter/lm_trainer.py``, ``drafter/streaming.py``)."""

    def __init__(
        self, drafter: Any, buffer_bytes: int, training: Any = None, holdout_every: int = 4, min_gain: float = 0.0
    ) -> None:
        super().__init__(buffer_bytes, holdout_every, min_gain)
        self.drafter = drafter  # a SmallLMDrafter, or the bare LM
        self._learn(*learner_for(drafter, None, training))

    def engine_drafter(self, policy: nn.Module, config: Any) -> Any:
        return self.drafter


class ExitAdapterTraining(GatedTraining):
    """``self:L``'s exit adapter of rank ``rank`` (Kangaroo), trained towards the policy's own
    next-token distributions, the policy as it is at each call being the teacher."""

    def __init__(
        self,
        layers: int,
        rank: int,
        buffer_bytes: int = 64 << 20,
        training: Any = None,
        holdout_every: int = 4,
        min_gain: float = 0.0,
    ) -> None:
        super().__init__(buffer_bytes, holdout_every, min_gain)
        check_training_config(training, "PartFitConfig", "an exit adapter")
        self.layers, self.rank, self.training = layers, rank, training

    @property
    def adapter(self) -> nn.Module | None:
        return self.part

    def engine_drafter(self, policy: nn.Module, config: Any) -> Drafter:
        from .factory import as_drafter
        from .part_learning import ExitAdapterLearner
        from .self_spec import ExitAdapter

        if self.learning is None:  # made with the first engine: it needs the hidden size
            adapter = ExitAdapter(policy.config.hidden_size, self.rank)
            self._learn(adapter, ExitAdapterLearner(policy, self.layers, self.training))
        self.learning.learner.policy = policy  # the teacher: the policy as it is now
        adapter = self.part.to(next(policy.parameters()).device)
        return as_drafter(f"self:{self.layers}", policy, config, adapter=adapter)


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
        from .lm_trainer import versioned_lm

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
    trains its streaming heads if it has them, else its own weights. All but an EAGLE-3 head ship
    behind the held-out gate (``holdout_every``, ``ship_min_gain``)."""
    from .eagle3 import Eagle3Head
    from .factory import parse_self_drafter
    from .small_lm import SmallLMDrafter

    if adapter_rank is not None:
        if not isinstance(drafter, str):
            raise ValueError(f"self_adapter_rank is for drafter='self:L', got drafter={type(drafter).__name__}")
        layers = parse_self_drafter(drafter)
        return ExitAdapterTraining(layers, adapter_rank, buffer_bytes, training, holdout_every, ship_min_gain)
    if steps == 0:
        return None
    if isinstance(drafter, Eagle3Head):
        return HeadTraining(drafter, buffer_bytes, training)
    if isinstance(drafter, (SmallLMDrafter, nn.Module)):
        return DraftLMTraining(drafter, buffer_bytes, training, holdout_every, ship_min_gain)
    raise ValueError(
        "drafter_train_steps > 0 needs an EAGLE-3 head (SpecRollout(drafter=head)), a drafter LM "
        "(SpecRollout(drafter=lm) or a SmallLMDrafter) or drafter='self:L' with self_adapter_rank set"
    )
