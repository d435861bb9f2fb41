"""Catch-up: train a drafter harder while its acceptance has fallen far below what it reached.

RL moves the policy slowly most of the time, and a drafter trained online keeps up at a low
learning rate (a higher one makes a warm head worse on an unmoved policy). Sometimes the policy
jumps: a new response format, a new task mix. Then the head's accept length falls at once and a
low learning rate relearns the new text slowly. :class:`CatchUp` watches the accept length of
each rollout against a *reference* (the best recent one, forgotten by ``decay`` per rollout, so
that a level the drafter can no longer reach stops counting), and while a rollout falls below
``below`` times it, drafter training runs at ``lr_scale`` times its learning rate. Spot training's
held-out gate still decides whether what it trained ships.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config_tree import require


@dataclass
class CatchUpConfig:
    below: float = 0.8  # a rollout under this share of the reference accept length starts catch-up (0: off)
    lr_scale: float = 10.0  # the drafter's learning rate is multiplied by this during catch-up
    decay: float = 0.97  # per rollout: the reference falls to this share of itself unless a rollout beats it

    def __post_init__(self) -> None:
        checks = [
            ("below", 0 <= self.below < 1, "a float in [0, 1) (0 = off)"),
            ("lr_scale", self.lr_scale >= 1 and math.isfinite(self.lr_scale), "a finite float >= 1"),
            ("decay", 0 < self.decay <= 1, "a float in (0, 1]"),
        ]
        for name, ok, allowed in checks:
            require(ok, name, allowed, getattr(self, name))


class CatchUp:
    """The learning-rate scale for drafter training after each rollout's accept length."""

    def __init__(self, config: CatchUpConfig | None = None) -> None:
        self.config = config or CatchUpConfig()
        self.reference: float | None = None
        self.lr_scale = 1.0
        self.rollouts_caught_up = 0  # rollouts after which training ran scaled

    def observe(self, accept_length: float, drafted_tokens: int) -> float:
        """Fold in one rollout's mean accept length (one that drafted nothing is skipped); returns
        the scale for the training that follows it."""
        c = self.config
        if c.below <= 0 or drafted_tokens <= 0:
            return self.lr_scale
        behind = self.reference is not None and accept_length < c.below * self.reference
        self.lr_scale = c.lr_scale if behind else 1.0
        self.rollouts_caught_up += int(behind)
        decayed = self.reference * c.decay if self.reference is not None else 0.0
        self.reference = max(accept_length, decayed)
        return self.lr_scale

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "lr_scale": self.lr_scale, "rollouts_caught_up": self.rollouts_caught_up}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.reference = state.get("reference")
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.rollouts_caught_up = int(state.get("rollouts_caught_up", 0))
