"""How a drafter part learns apart from the copy that drafts, and when a trained copy ships.

A :class:`Learner` is what differs between kinds of trained part: the samples it records, its
trainer, and its held-out score (accepted draft tokens per greedy chain):

=======================  ==========================  ============================================
learner                  trains                      on (held-out score)
=======================  ==========================  ============================================
:class:`Eagle3Learner`   an EAGLE-3 head             target features its drafter recorded
                                                     (top-1 chain acceptance)
:class:`DraftLMLearner`  a drafter LM (whole)        the policy's prompt + completion sequences
                                                     (expected accepted run of a sampled chain)
``StreamingHeads...``    a drafter LM's streaming    the same sequences (expected run of the
                         heads (the LM frozen)       streamed chain)
``ExitAdapterLearner``   ``self:L``'s exit adapter   the same sequences, towards the policy's own
                                                     distributions (expected run of the early exit)
=======================  ==========================  ============================================

:class:`PartLearning` is what is the same: a training copy of the drafting part and its trainer,
the samples it trains on, every n-th sample held out instead, and a copy of the shipped part that
a trained one must beat on them by more than a gain before it ships. Spot training on Ray workers
(``workers/spot_chunk.py``) and online training in the trainer's process (``drafter/online_training.py``)
both run on it, so every trainable part passes the same gate.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any, ClassVar, Protocol

from torch import nn

from .eagle3.data import FeatureBuffer
from .eagle3.train import TrainStepResult
from .lm_trainer import DraftLMTrainer, DraftLMTrainingConfig, lm_held_out_acceptance, versioned_lm
from .part_trainer import PartFitConfig, SequenceFitTrainer, StopCheck
from .state import DrafterState, PartOptimizerHolder, TrainedPart

HELD_OUT_SAMPLES = 24  # the newest held-out samples parts are compared on: what the policy writes now


class StepTrainer(PartOptimizerHolder, Protocol):
    """A trainer that takes steps from its ``buffer`` at ``lr_scale`` x its learning rate."""

    buffer: FeatureBuffer
    lr_scale: float

    def train(self, num_steps: int, *, should_stop: StopCheck | None = None) -> list[TrainStepResult]: ...


class Learner(Protocol):
    """What one kind of trained part needs to learn. ``records`` says where its samples come from:
    ``"features"`` (its engine drafter records them while drafting) or ``"sequences"`` (the
    finished requests' prompt + completion)."""

    records: ClassVar[str]

    def trainer(self, part: TrainedPart, buffer: FeatureBuffer) -> StepTrainer: ...

    def score(self, part: TrainedPart, samples: list[Any], should_stop: StopCheck | None) -> float | None:
        """Accepted draft tokens per greedy chain on ``samples``; None when ``should_stop`` said stop."""


class Eagle3Learner:
    """An EAGLE-3 head, reading the input embeddings of ``policy``."""

    records = "features"

    def __init__(self, policy: nn.Module, training: Any = None) -> None:
        from .eagle3.train import DrafterTrainingConfig

        self.policy = policy
        self.training = training or DrafterTrainingConfig()

    def trainer(self, part: TrainedPart, buffer: FeatureBuffer) -> StepTrainer:
        from .eagle3.train import DrafterTrainer

        return DrafterTrainer(part, self.policy.get_input_embeddings(), buffer, self.training)

    def score(self, part: TrainedPart, samples: list[Any], should_stop: StopCheck | None) -> float | None:
        from .eagle3.train import held_out_acceptance

        embed = self.policy.get_input_embeddings()
        return held_out_acceptance(part, embed, samples, self.training.ttt_steps, should_stop=should_stop)


class DraftLMLearner:
    """A drafter LM's own weights (:class:`~tailspec.drafter.lm_trainer.VersionedLM`)."""

    records = "sequences"

    def __init__(self, training: DraftLMTrainingConfig | None = None) -> None:
        self.training = training or DraftLMTrainingConfig()

    def trainer(self, part: TrainedPart, buffer: FeatureBuffer) -> StepTrainer:
        return DraftLMTrainer(part, buffer, self.training)

    def score(self, part: TrainedPart, samples: list[Any], should_stop: StopCheck | None) -> float | None:
        c = self.training
        return lm_held_out_acceptance(part.model, samples, c.depth, c.max_tokens, should_stop=should_stop)


STREAMING_LR = 2e-3  # the base learning rates of the small parts (PartFitConfig.learning_rate=None)
ADAPTER_LR = 1e-3


class StreamingHeadsLearner:
    """A drafter LM's streaming heads; the LM (``model``) is not trained."""

    records = "sequences"

    def __init__(self, model: nn.Module, training: PartFitConfig | None = None) -> None:
        self.model = model
        self.training = training or PartFitConfig()

    def trainer(self, part: TrainedPart, buffer: FeatureBuffer) -> StepTrainer:
        from .streaming import StreamingHeadTrainer

        c = self.training
        lr = c.learning_rate or STREAMING_LR
        fit = StreamingHeadTrainer(self.model, part, lr=lr, rows=c.rows, seed=c.seed)
        return SequenceFitTrainer(fit, buffer, c, lr, minimum=len(part) + 3)

    def score(self, part: TrainedPart, samples: list[Any], should_stop: StopCheck | None) -> float | None:
        from .streaming import streamed_held_out_acceptance

        c = self.training
        return streamed_held_out_acceptance(self.model, part, samples, c.depth, c.max_tokens, should_stop=should_stop)


class ExitAdapterLearner:
    """``self:L``'s exit adapter, towards the next-token distributions of ``policy`` (the teacher:
    set ``policy`` to the policy as it is at each call; the trainers it made follow it)."""

    records = "sequences"

    def __init__(self, policy: nn.Module, num_layers: int, training: PartFitConfig | None = None) -> None:
        self.num_layers = num_layers
        self.training = training or PartFitConfig()
        self._fit: Any = None  # the newest trainer's fit: the one that trains
        self.policy = policy

    @property
    def policy(self) -> nn.Module:
        return self._policy

    @policy.setter
    def policy(self, policy: nn.Module) -> None:
        self._policy = policy
        if self._fit is not None:
            self._fit.target = policy

    def trainer(self, part: TrainedPart, buffer: FeatureBuffer) -> StepTrainer:
        from .self_spec import ExitAdapterTrainer

        c = self.training
        lr = c.learning_rate or ADAPTER_LR
        self._fit = ExitAdapterTrainer(self.policy, part, self.num_layers, lr=lr, rows=c.rows, seed=c.seed)
        return SequenceFitTrainer(self._fit, buffer, c, lr, minimum=2)

    def score(self, part: TrainedPart, samples: list[Any], should_stop: StopCheck | None) -> float | None:
        from .self_spec import adapted_held_out_acceptance

        c = self.training
        return adapted_held_out_acceptance(
            self.policy, self.num_layers, part, samples, c.depth, c.max_tokens, should_stop=should_stop
        )


def learner_for(drafter: Any, policy: nn.Module | None, training: Any = None) -> tuple[TrainedPart, Learner] | None:
    """The part of ``drafter`` that trains apart from the drafting copy, and its learner: an EAGLE-3
    head; a ``SelfSpecDrafter``'s exit adapter; a drafter LM's streaming heads if it has them, else
    its whole LM (a ``SmallLMDrafter`` or the bare model); None for other drafters.
    ``training``: the learner's config (``DrafterTrainingConfig`` for a head,
    ``DraftLMTrainingConfig`` for a drafter LM, ``PartFitConfig`` for streaming heads or an exit
    adapter; None: the defaults)."""
    from .eagle3 import Eagle3Head
    from .self_spec import SelfSpecDrafter
    from .small_lm import SmallLMDrafter

    if isinstance(drafter, Eagle3Head):
        check_training_config(training, "DrafterTrainingConfig", "an EAGLE-3 head")
        return drafter, Eagle3Learner(policy, training)
    if isinstance(drafter, SelfSpecDrafter):
        if drafter.adapter is None:
            return None
        check_training_config(training, "PartFitConfig", "an exit adapter")
        return drafter.adapter, ExitAdapterLearner(policy, drafter.num_layers, training)
    if isinstance(drafter, SmallLMDrafter) and drafter.heads is not None:
        check_training_config(training, "PartFitConfig", "streaming heads")
        return drafter.heads, StreamingHeadsLearner(drafter.model, training)
    if isinstance(drafter, SmallLMDrafter):
        check_training_config(training, "DraftLMTrainingConfig", "a drafter LM")
        return drafter.lm, DraftLMLearner(training)
    if isinstance(drafter, nn.Module):  # a bare drafter LM: each engine builds its SmallLMDrafter on it
        check_training_config(training, "DraftLMTrainingConfig", "a drafter LM")
        return versioned_lm(drafter), DraftLMLearner(training)
    return None


def check_training_config(training: Any, expected: str, what: str) -> None:
    if training is not None and type(training).__name__ != expected:
        raise ValueError(f"drafter_training for {what} must be a {expected}, got {type(training).__name__}")


def beats(held_out: tuple[float, float], gain: float) -> bool:
    """The trained part's held-out score beats the shipped part's by more than ``gain``."""
    shipped, trained = held_out
    return trained > shipped + gain


class PartLearning:
    """The training copy of ``part`` (the drafting one changes only when a state is loaded into it),
    its trainer, its training samples and held-out samples, and the copy of the shipped part it is
    judged against."""

    def __init__(self, part: TrainedPart, learner: Learner) -> None:
        self.part, self.learner = part, learner
        self.trainer: StepTrainer | None = None
        self.train_buffer: FeatureBuffer | None = None  # samples to train on, kept between calls
        self.train_part: TrainedPart | None = None  # the copy training updates
        self.held_out: deque[Any] = deque(maxlen=HELD_OUT_SAMPLES)  # never trained on
        self.reference: TrainedPart | None = None  # a copy of the shipped part, what a trained one must beat
        self._held_out_added = 0
        self._reference_score: tuple[tuple[int, int], float] | None = None  # ((version, held-out adds), score)
        self._samples_received = 0

    def take(self, samples: list[Any], buffer_bytes: int, holdout_every: int) -> None:
        """Into the training buffer (``buffer_bytes``, newest kept), every ``holdout_every``-th (0:
        none) into the held-out set instead."""
        if self.train_buffer is None or self.train_buffer.max_bytes != buffer_bytes:
            self.train_buffer = FeatureBuffer(buffer_bytes)
        for sample in samples:
            self._samples_received += 1
            if holdout_every and self._samples_received % holdout_every == 0:
                self.held_out.append(sample)
                self._held_out_added += 1
            else:
                self.train_buffer.add(sample)

    def prepare(self, state: DrafterState | None, shipped: DrafterState | None, lr_scale: float) -> None:
        """The training copy from ``state`` (weights, optimizer, step), or continuing (None); the
        reference to beat set to ``shipped`` when given."""
        if self.train_part is None:
            self.train_part = copy.deepcopy(self.part)
            self.reference = copy.deepcopy(self.part)
        if shipped is not None:
            shipped.load_into(self.reference)
        if state is not None:
            state.load_into(self.train_part)
            self.trainer = self.learner.trainer(self.train_part, self.train_buffer)
            state.load_trainer(self.trainer)
        elif self.trainer is None:
            raise RuntimeError("no trainer to continue; send a DrafterState")
        self.trainer.buffer = self.train_buffer
        self.trainer.lr_scale = lr_scale

    @property
    def judging(self) -> bool:
        return bool(self.held_out)

    def train(self, max_steps: int, should_stop: StopCheck | None = None) -> list[TrainStepResult]:
        if not len(self.train_buffer):
            return []
        return self.trainer.train(max_steps, should_stop=should_stop)

    def compare(self, should_stop: StopCheck | None = None) -> tuple[float, float] | None:
        """(shipped part's, trained part's) score on the held-out samples, or None when a stop cut
        it short; the shipped part's score is reused while neither it nor the held-out set changed."""
        samples = list(self.held_out)
        key = (int(self.reference.version), self._held_out_added)
        if self._reference_score is None or self._reference_score[0] != key:
            score = self.learner.score(self.reference, samples, should_stop)
            if score is None:
                return None
            self._reference_score = (key, score)
        trained = self.learner.score(self.train_part, samples, should_stop)
        return None if trained is None else (self._reference_score[1], trained)

    def shipped(self, *into: TrainedPart) -> None:
        """The trained copy is the one to beat from now on; its weights and version also go
        ``into`` the given parts (the drafting one, where it lives in this process)."""
        for part in (self.reference, *into):
            part.load_state_dict(self.train_part.state_dict())
            part.version = self.train_part.version

    def trained_state(self) -> DrafterState:
        return DrafterState.of(self.train_part, self.trainer)
