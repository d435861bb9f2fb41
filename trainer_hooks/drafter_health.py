"""Drafter health across RL steps: one number for the logs, and one warning when drafting fails.

Users of other RL frameworks lost days to a run that went quietly to 1.0x: acceptance pinned at 0
after the draft weights were dropped on a refit. After every rollout :class:`DrafterHealth` scores
the drafter by the gain of its speculative steps over plain decoding (accept length - 1) against the
best gain it reached so far in the run (``rollout/drafter_health``: 1.0 at its best, 0.0 when it
drafted nothing), and warns, once per episode with the numbers and what to check, when
- a drafter that drafted well falls under ``floor`` x its best gain, or
- ``adaptive`` has a model drafter and ran none of its arms in a whole rollout (the selector ruled
  every drafting arm out).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

WHAT_TO_CHECK = (
    "check that the drafter's weights reached the workers after the last policy sync, that drafter and "
    "policy share a tokenizer, and whether the policy has moved away from what the drafter learned "
    "(train it online: drafter_train_steps, or spot training on Ray workers)"
)


@dataclass
class DrafterHealth:
    floor: float = 0.5  # warn when the accept length falls under this x the best of the run
    best: float = 0.0  # the best accept length a rollout of the run reached (1.0 = no draft accepted)
    scores: list[float] = field(default_factory=list)
    _warned: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.floor < 1:
            raise ValueError(f"DrafterHealth.floor must be in (0, 1), got {self.floor!r}")

    def update(self, accept_length: float, model_drafter_steps: int, adaptive: bool) -> float:
        """Score one rollout: ``accept_length`` (tokens per sequence per speculative step) of its
        model-drafter steps, ``model_drafter_steps`` decode steps that drafted with the model."""
        if model_drafter_steps == 0:
            score = 0.0
            problem = (
                "strategy 'adaptive' ran none of its model-drafter arms in this rollout (the selector "
                f"ruled them all out; best accept length so far {self.best:.2f})"
                if adaptive
                else None
            )
        else:
            self.best = max(self.best, accept_length)
            score = (accept_length - 1) / (self.best - 1) if self.best > 1 else 1.0
            problem = (
                f"the drafter's accept length fell to {accept_length:.2f} from a best of {self.best:.2f} "
                f"in this run (under {self.floor:.0%} of its gain)"
                if score < self.floor
                else None
            )
        if problem is not None and not self._warned:
            logger.warning("drafter health: %s; %s", problem, WHAT_TO_CHECK)
        self._warned = problem is not None  # one warning per episode of bad health
        self.scores.append(score)
        return score
