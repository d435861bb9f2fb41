"""A worker's side of spot training: one chunk of steps on the drafter's trained part, then the
judgement that decides whether it ships.

The coordinator's :class:`~tailspec.workers.spot.SpotTraining` decides when and where a chunk runs;
the worker's :class:`SpotTrainer` runs it on a :class:`~tailspec.drafter.part_learning.PartLearning`: a
copy of the part trains (the drafting part changes only when a state is broadcast), the samples it
was sent (each once) go to its training buffer except every n-th, which it holds out, and a trained
part is judged against a copy of the shipped one on those held-out samples (accepted draft tokens
per chain): better by more than the gain, it ships. The part is an EAGLE-3 head or a drafter LM
(``drafter/part_learning.py``). A stop names its chunk by number (it may arrive before the chunk's own
call) and cuts the steps and the comparison short within one training step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..drafter.online_training import DrafterState, TrainedPart
from ..drafter.part_learning import Learner, PartLearning, beats


@dataclass
class TrainResult:
    worker: int
    state: DrafterState
    losses: list[float]
    stopped: bool  # yielded before max_steps (rollout over or work arrived)
    # (drafting part's, trained part's) accepted draft tokens per chain on the held-out samples;
    # None while none is held out
    held_out: tuple[float, float] | None = None
    held_out_against: int | None = None  # the shipped version the trained part was compared with
    ship: bool = True  # the trained part beat it (or nothing was held out): the engines should draft with it
    # False: a stop cut the comparison short, so the state is neither shipped nor known to lose
    judged: bool = True


class SpotTrainer:
    """Spot training of ``part`` (learning as ``learner`` says) on worker ``index``;
    ``event(kind, **detail)`` records what happens on the worker's event log."""

    def __init__(self, index: int, part: TrainedPart, learner: Learner, event: Callable[..., None]) -> None:
        self.index, self._event = index, event
        self.learning = PartLearning(part, learner)
        # chunk numbers (the coordinator's): the running one, and the highest told to stop. A stop
        # may overtake its chunk's call (the actor is threaded, and the call carries the samples),
        # so it names the chunk instead of setting a flag the chunk would clear
        self._chunk = -1
        self._stopped_upto = -1

    def train(
        self,
        state: DrafterState | None,
        new_samples: list[Any],
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
        hold the coordinator's latest version. After the steps the trained part is compared on the
        held-out set with the shipped one (``shipped``: its state, sent when this worker's copy is
        not it) by the learner's score, and ships when it is better by more than
        ``ship_min_gain`` (then it is the copy to beat from now on). ``lr_scale`` multiplies the
        learning rate (catch-up, ``drafter/catch_up.py``). Returns the new state.

        A stop also cuts the comparison short (it is checked before every batch of held-out
        samples), so a chunk yields within one training step: the result is then not judged
        (``judged=False``, no ship). ``judge_first`` (the coordinator's newest state was never
        judged) compares before training: a part that wins ships at once, with no new steps.
        ``chunk`` numbers the call (rising), so that a stop sent for it takes effect even when it
        arrives first; None: the next number."""
        self._chunk = self._stopped_upto + 1 if chunk is None else chunk
        learning = self.learning
        learning.take(new_samples, buffer_bytes, holdout_every)
        self._event("train_start", from_version=None if state is None else state.version, new=len(new_samples))
        learning.prepare(state, shipped, lr_scale)
        judging = bool(holdout_every) and learning.judging
        against = int(learning.reference.version)
        held_out = None
        if judge_first and judging:
            held_out = learning.compare(self._stop_asked)
            if held_out is None or beats(held_out, ship_min_gain):  # cut short, or ships as it is
                shipping = held_out is not None
                return self._train_result([], held_out, against, ship=shipping, stopped=not shipping, judged=shipping)
        results = learning.train(max_steps, self._stop_asked)
        losses = [r.loss for r in results]
        for r in results:
            self._event("train_step", step=r.step, loss=r.loss, seconds=round(r.time_s, 3))
        if losses and judging:
            judging_from = time.perf_counter()
            held_out = learning.compare(self._stop_asked)
            self._event("judged", seconds=round(time.perf_counter() - judging_from, 3), done=held_out is not None)
        judged = held_out is not None or not judging
        ship = bool(losses) and judged and (held_out is None or beats(held_out, ship_min_gain))
        return self._train_result(losses, held_out, against, ship=ship, stopped=len(losses) < max_steps, judged=judged)

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
        if ship:
            self.learning.shipped()
        version = int(self.learning.train_part.version)
        self._event("train_end", version=version, steps=len(losses), stopped=stopped, ship=ship, judged=judged)
        return TrainResult(self.index, self.learning.trained_state(), losses, stopped, held_out, against, ship, judged)

    def stop(self, chunk: int | None = None) -> None:
        """Make :meth:`train` call ``chunk`` (None: the running one) return before its next step,
        or at once if it has not started yet."""
        self._stopped_upto = max(self._stopped_upto, self._chunk if chunk is None else chunk)

    def _stop_asked(self) -> bool:
        return self._stopped_upto >= self._chunk
