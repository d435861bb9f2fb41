"""A worker's side of spot training: one chunk of steps on the EAGLE-3 head, then the judgement
that decides whether it ships.

The coordinator's :class:`~tailspec.workers.spot.SpotTraining` decides when and where a chunk runs;
the worker's :class:`SpotTrainer` runs it. It trains a copy of the head (the drafting head changes
only when a state is broadcast), keeps the samples it was sent (each once) in its training buffer
except every n-th, which it holds out, and judges a trained head against a copy of the shipped one
on those held-out samples (accepted draft tokens per chain): better by more than the gain, it
ships. A stop names its chunk by number (it may arrive before the chunk's own call) and cuts the
steps and the comparison short within one training step.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..drafter.eagle3 import Eagle3Head, FeatureBuffer
from ..drafter.eagle3.data import Eagle3Sample
from ..drafter.eagle3.train import DrafterTrainer, DrafterTrainingConfig, held_out_acceptance
from ..drafter.online import DrafterState

HELD_OUT_SAMPLES = 24  # the newest held-out samples heads are compared on: what the policy writes now


@dataclass
class TrainResult:
    worker: int
    state: DrafterState
    losses: list[float]
    stopped: bool  # yielded before max_steps (rollout over or work arrived)
    # (drafting head's, trained head's) accepted draft tokens per chain on the held-out samples;
    # None while none is held out
    held_out: tuple[float, float] | None = None
    held_out_against: int | None = None  # the shipped version the trained head was compared with
    ship: bool = True  # the trained head beat it (or nothing was held out): the engines should draft with it
    # False: a stop cut the comparison short, so the state is neither shipped nor known to lose
    judged: bool = True


def _beats(held_out: tuple[float, float], gain: float) -> bool:
    """The trained head's held-out score beats the shipped head's by more than ``gain``."""
    shipped, trained = held_out
    return trained > shipped + gain


class SpotTrainer:
    """The training copy of ``head``, its trainer, buffer and held-out samples on worker ``index``
    (``model``: the worker's policy, whose embeddings the head reads); ``event(kind, **detail)``
    records what happens on the worker's event log."""

    def __init__(
        self,
        index: int,
        head: Eagle3Head,
        model: torch.nn.Module,
        training: DrafterTrainingConfig | None,
        event: Callable[..., None],
    ) -> None:
        self.index, self.head, self.model, self.training, self._event = index, head, model, training, event
        self.trainer: DrafterTrainer | None = None
        self.train_buffer: FeatureBuffer | None = None  # samples sent for spot training, kept between chunks
        self.train_head: Eagle3Head | None = None  # the copy spot training updates
        self.held_out: deque[Eagle3Sample] = deque(maxlen=HELD_OUT_SAMPLES)  # never trained on
        self.reference: Eagle3Head | None = None  # a copy of the shipped head, what a trained one must beat
        self._held_out_added = 0
        self._reference_score: tuple[tuple[int, int], float] | None = None  # ((version, held-out adds), score)
        self._samples_received = 0
        # chunk numbers (the coordinator's): the running one, and the highest told to stop. A stop
        # may overtake its chunk's call (the actor is threaded, and the call carries the samples),
        # so it names the chunk instead of setting a flag the chunk would clear
        self._chunk = -1
        self._stopped_upto = -1

    def train(
        self,
        state: DrafterState | None,
        new_samples: list[Eagle3Sample],
        max_steps: int,
        buffer_bytes: int,
        holdout_every: int = 0,
        shipped: DrafterState | None = None,
        ship_min_gain: float = 0.0,
        lr_scale: float = 1.0,
        judge_first: bool = False,
        chunk: int | None = None,
    ) -> TrainResult:
        """Up to ``max_steps`` training steps, checking for :meth:`stop_training` before every one.

        ``new_samples`` are added to this worker's training buffer (the coordinator sends each
        sample once per worker; ``buffer_bytes`` caps it, newest kept, as the coordinator's own),
        but every ``holdout_every``-th one (0: none) goes to a held-out set instead. ``state`` is
        where to start from, or None to continue from this worker's own trainer, which must then
        hold the coordinator's latest version. After the steps the trained head is compared on the
        held-out set with the shipped one (``shipped``: its state, sent when this worker's copy is
        not it) by :func:`held_out_acceptance`, and ships when it is better by more than
        ``ship_min_gain`` (then it is the copy to beat from now on). ``lr_scale`` multiplies the
        learning rate (catch-up, ``drafter/catch_up.py``). Returns the new state.

        A stop also cuts the comparison short (it is checked before every batch of held-out
        samples), so a chunk yields within one training step: the result is then not judged
        (``judged=False``, no ship). ``judge_first`` (the coordinator's newest state was never
        judged) compares before training: a head that wins ships at once, with no new steps.
        ``chunk`` numbers the call (rising), so that a stop sent for it takes effect even when it
        arrives first; None: the next number."""
        self._chunk = self._stopped_upto + 1 if chunk is None else chunk
        self._take_samples(new_samples, buffer_bytes, holdout_every)
        self._event("train_start", from_version=None if state is None else state.version, new=len(new_samples))
        self._prepare_trainer(state, shipped, lr_scale)
        judging = bool(holdout_every and self.held_out)
        against = int(self.reference.version)
        held_out = None
        if judge_first and judging:
            held_out = self._compare_on_held_out()
            if held_out is None or _beats(held_out, ship_min_gain):  # cut short, or ships as it is
                shipping = held_out is not None
                return self._train_result([], held_out, against, ship=shipping, stopped=not shipping, judged=shipping)
        results = self.trainer.train(max_steps, should_stop=self._stop_asked) if len(self.train_buffer) else []
        losses = [r.loss for r in results]
        for r in results:
            self._event("train_step", step=r.step, loss=r.loss, seconds=round(r.time_s, 3))
        if losses and judging:
            judging_from = time.perf_counter()
            held_out = self._compare_on_held_out()
            self._event("judged", seconds=round(time.perf_counter() - judging_from, 3), done=held_out is not None)
        judged = held_out is not None or not judging
        ship = bool(losses) and judged and (held_out is None or _beats(held_out, ship_min_gain))
        return self._train_result(losses, held_out, against, ship=ship, stopped=len(losses) < max_steps, judged=judged)

    def _take_samples(self, new_samples: list[Eagle3Sample], buffer_bytes: int, holdout_every: int) -> None:
        """Into the training buffer (``buffer_bytes``, newest kept), every ``holdout_every``-th (0:
        none) into the held-out set instead."""
        if self.train_buffer is None or self.train_buffer.max_bytes != buffer_bytes:
            self.train_buffer = FeatureBuffer(buffer_bytes)
        for sample in new_samples:
            self._samples_received += 1
            if holdout_every and self._samples_received % holdout_every == 0:
                self.held_out.append(sample)
                self._held_out_added += 1
            else:
                self.train_buffer.add(sample)

    def _prepare_trainer(self, state: DrafterState | None, shipped: DrafterState | None, lr_scale: float) -> None:
        """The copy that trains (apart from the drafting head, which changes only by broadcast), from
        ``state`` or continuing; the reference to beat, set to ``shipped`` when sent."""
        if self.train_head is None:
            self.train_head = copy.deepcopy(self.head)
            self.reference = copy.deepcopy(self.head)
        if shipped is not None:
            shipped.load_into(self.reference)
        if state is not None:
            state.load_into(self.train_head)
            self.trainer = DrafterTrainer(
                self.train_head, self.model.get_input_embeddings(), self.train_buffer, self.training
            )
            if state.optimizer is not None:
                self.trainer.optimizer.load_state_dict(state.optimizer)
            self.trainer.step_count = state.step
        elif self.trainer is None:
            raise RuntimeError(f"worker {self.index} has no trainer to continue; send a DrafterState")
        self.trainer.buffer = self.train_buffer
        self.trainer.lr_scale = lr_scale

    def _train_result(
        self,
        losses: list[float],
        held_out: tuple[float, float] | None,
        against: int,
        *,
        ship: bool,
        stopped: bool,
        judged: bool = True,
    ) -> TrainResult:
        if ship:  # the copy to beat from now on
            self.reference.load_state_dict(self.train_head.state_dict())
            self.reference.version = self.train_head.version
        self._event(
            "train_end", version=int(self.train_head.version), steps=len(losses), stopped=stopped, ship=ship,
            judged=judged,
        )  # fmt: skip
        state = DrafterState.of(self.train_head, self.trainer)
        return TrainResult(self.index, state, losses, stopped, held_out, against, ship, judged)

    def _compare_on_held_out(self) -> tuple[float, float] | None:
        """(shipped head's, trained head's) accepted draft tokens per chain on the held-out samples,
        or None when a stop cut it short; the shipped head's score is reused while neither it nor
        the held-out set changed."""
        embed, samples = self.model.get_input_embeddings(), list(self.held_out)
        depth, stop = self.trainer.config.ttt_steps, self._stop_asked
        key = (int(self.reference.version), self._held_out_added)
        if self._reference_score is None or self._reference_score[0] != key:
            score = held_out_acceptance(self.reference, embed, samples, depth, should_stop=stop)
            if score is None:
                return None
            self._reference_score = (key, score)
        trained = held_out_acceptance(self.train_head, embed, samples, depth, should_stop=stop)
        return None if trained is None else (self._reference_score[1], trained)

    def stop(self, chunk: int | None = None) -> None:
        """Make :meth:`train` call ``chunk`` (None: the running one) return before its next step,
        or at once if it has not started yet."""
        self._stopped_upto = max(self._stopped_upto, self._chunk if chunk is None else chunk)

    def _stop_asked(self) -> bool:
        return self._stopped_upto >= self._chunk
