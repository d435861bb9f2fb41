"""What any trained drafter part is, and what carries it: :class:`DrafterState` (weights, version,
the trainer's step and optimizer) goes to Ray workers and into checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class TrainedPart(Protocol):
    """A drafter part that training changes: an ``nn.Module`` with a ``version`` every step bumps
    (an EAGLE-3 head, a drafter LM's streaming heads, ``self:L``'s exit adapter)."""

    version: int

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> Any: ...


class PartOptimizerHolder(Protocol):
    """A trainer of a part: its step count and optimizer (``DrafterTrainer``, ``PartTrainer``)."""

    step_count: int
    optimizer: torch.optim.Optimizer


@dataclass
class DrafterState:
    """A trained drafter part's weights and version, and its trainer's step and optimizer state:
    what continues its training elsewhere (a Ray worker, a resumed run)."""

    weights: dict[str, torch.Tensor]
    version: int
    step: int = 0
    optimizer: dict[str, Any] | None = None

    @classmethod
    def of(cls, part: TrainedPart, trainer: PartOptimizerHolder | None = None) -> DrafterState:
        return cls(
            weights={k: v.detach().cpu().clone() for k, v in part.state_dict().items()},
            version=int(part.version),
            step=trainer.step_count if trainer is not None else 0,
            optimizer=trainer.optimizer.state_dict() if trainer is not None else None,
        )

    def load_into(self, part: TrainedPart) -> None:
        part.load_state_dict(self.weights)
        part.version = self.version

    def load_trainer(self, trainer: PartOptimizerHolder) -> None:
        if self.optimizer is not None:
            trainer.optimizer.load_state_dict(self.optimizer)
        trainer.step_count = self.step
