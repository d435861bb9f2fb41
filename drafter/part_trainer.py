"""What the fits of small drafter parts (streaming heads, an exit adapter) share: the trainer's
loop (:class:`PartTrainer`), and its online form (:class:`SequenceFitTrainer`), steps drawn from a
buffer of the policy's sequences, as the held-out gate of ``drafter/part_learning.py`` drives them."""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config_tree import require
from .eagle3.data import FeatureBuffer
from .eagle3.train import TrainStepResult
from .lm_trainer import SequenceSample, window

StopCheck = Callable[[], bool]


@contextmanager
def frozen(*modules: nn.Module) -> Iterator[None]:
    """Within the block, gradients flow through ``modules`` but never into their parameters
    (a fit trains a small part in front of a model's own norm or LM head)."""
    params = [(p, p.requires_grad) for m in modules for p in m.parameters()]
    for p, _ in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in params:
            p.requires_grad_(flag)


class PartTrainer(ABC):
    """What the trainers of a small drafter part (streaming heads, an exit adapter) share: an
    optimizer kept between calls, a seeded row sampler (``rows`` per step), a step count, and the
    part's ``version`` bumped by every step (the selector then re-measures the drafter's arms, a
    draft process re-ships the weights). A subclass reads its ``examples`` off sequences once and
    says what one step's ``loss`` is on rows drawn from them."""

    def __init__(self, part: nn.Module, lr: float, seed: int, rows: int) -> None:
        require(isinstance(rows, int) and rows >= 1, "rows", "an int >= 1", rows)
        self.part = part
        self.batch_rows = rows
        self.optimizer = torch.optim.AdamW(part.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.step_count = 0

    @abstractmethod
    def examples(self, sequences: Sequence[Sequence[int]], should_stop: StopCheck | None = None) -> Any:
        """What the steps draw rows from (None when ``should_stop`` said stop first)."""

    @abstractmethod
    def loss(self, examples: Any) -> torch.Tensor:
        """One step's loss on rows drawn from ``examples``."""

    @contextmanager
    def fitting(self) -> Iterator[None]:
        """Held around the steps: the modules the part feeds kept frozen, the part in train mode."""
        yield

    def rows(self, available: int, wanted: int) -> torch.Tensor:
        """``wanted`` row indices (at most ``available``) drawn from the seeded sampler."""
        return torch.randint(0, available, (min(wanted, available),), generator=self.generator)

    def step(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step_count += 1
        self.part.version += 1
        return float(loss.detach())

    def train(
        self, sequences: Sequence[Sequence[int]], steps: int, should_stop: StopCheck | None = None
    ) -> list[float]:
        """Up to ``steps`` optimizer steps on rows drawn from ``sequences`` (``should_stop()`` is
        checked before each, and while the examples are read); the loss of each."""
        examples = self.examples(sequences, should_stop)
        if examples is None:
            return []
        losses = []
        with self.fitting():
            for _ in range(steps):
                if should_stop is not None and should_stop():
                    break
                losses.append(self.step(self.loss(examples)))
        return losses


@dataclass
class PartFitConfig:
    """TRL-style configuration of a small drafter part's online fit (streaming heads, ``self:L``'s
    exit adapter): each call reads the examples of the newest ``recent`` sequences once (at most
    ``max_tokens`` each), then takes its steps on ``rows`` positions drawn from them."""

    learning_rate: float | None = None  # None: the part's own (streaming heads 2e-3, exit adapter 1e-3)
    rows: int = 256
    recent: int = 96  # what the policy writes now: the last 4 RL steps of 24 completions
    max_tokens: int = 256
    depth: int = 4  # the chain depth the held-out gate scores
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("learning_rate", self.learning_rate is None or self.learning_rate > 0, "None or a float > 0"),
            ("rows", isinstance(self.rows, int) and self.rows >= 1, "an int >= 1"),
            ("recent", isinstance(self.recent, int) and self.recent >= 1, "an int >= 1"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 2, "an int >= 2"),
            ("depth", isinstance(self.depth, int) and 1 <= self.depth <= 16, "an int in [1, 16]"),
        ]
        for name, ok, allowed in checks:
            require(ok, name, allowed, getattr(self, name))


class SequenceFitTrainer:
    """A :class:`PartTrainer`'s steps as the held-out gate takes them (its ``StepTrainer``): from a
    buffer of :class:`~tailspec.drafter.lm_trainer.SequenceSample` s, at ``lr_scale`` x
    ``base_lr``, a call's examples read from the buffer's newest ``recent`` sequences (those of at
    least ``minimum`` tokens) before its steps."""

    def __init__(self, fit: PartTrainer, buffer: FeatureBuffer, config: PartFitConfig, base_lr: float, minimum: int):
        self.fit, self.buffer, self.config = fit, buffer, config
        self.base_lr, self.minimum = base_lr, minimum
        self.lr_scale = 1.0  # catch-up (drafter/catch_up.py); set before every call
        self.rng = random.Random(config.seed)

    @property
    def step_count(self) -> int:
        return self.fit.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.fit.step_count = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.fit.optimizer

    def sequences(self) -> list[list[int]]:
        """The token windows this call trains on."""
        newest: list[SequenceSample] = self.buffer.samples()[-self.config.recent :]
        spans = [(s, window(s, self.config.max_tokens, self.rng)) for s in newest]
        return [s.tokens[a:b].tolist() for s, (a, b) in spans if b - a >= self.minimum]

    def train(self, num_steps: int, *, should_stop: StopCheck | None = None) -> list[TrainStepResult]:
        require(isinstance(num_steps, int) and num_steps >= 0, "num_steps", "an int >= 0", num_steps)
        sequences = self.sequences()
        if not sequences or not num_steps:
            return []
        for group in self.fit.optimizer.param_groups:
            group["lr"] = self.base_lr * self.lr_scale
        start = time.perf_counter()
        losses = self.fit.train(sequences, num_steps, should_stop)
        each = (time.perf_counter() - start) / max(len(losses), 1)
        first = self.fit.step_count - len(losses)
        return [TrainStepResult(first + i + 1, loss, [], each) for i, loss in enumerate(losses)]
