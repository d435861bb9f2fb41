"""What the fits of small drafter parts (streaming heads, an exit adapter) share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


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


class PartTrainer:
    """What the trainers of a small drafter part (streaming heads, an exit adapter) share: an
    optimizer kept between calls, a seeded row sampler, a step count, and the part's ``version``
    bumped by every step (the selector then re-measures the drafter's arms, a draft process
    re-ships the weights)."""

    def __init__(self, part: nn.Module, lr: float, seed: int) -> None:
        self.part = part
        self.optimizer = torch.optim.AdamW(part.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.step_count = 0

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
