"""Drafter health across RL steps: one number for the logs, and one warning when drafting fails.

Users of other RL frameworks lost days to a run that went quietly to 1.0x: acceptance pinned at 0
after the draft weights were dropped on a refit. After every rollout :class:`DrafterHealth` scores
the drafter by the gain of its speculative steps over plain decoding (accept length - 1) against the
best gain it reached so far in the run (``rollout/drafter_health``: 1.0 at its best, 0.0 when it
drafted nothing), and warns, once per episode of each problem, with the numbers and what to check,
when
- the drafter does not fit the policy synced for the rollout (vocabulary, hidden size, tapped or
  shared layers; :meth:`DrafterHealth.fit`, called at every sync): the rollout decodes without it;
- a drafter that drafted well falls under ``floor`` x its best gain;
- ``adaptive`` has a model drafter and ran none of its arms in a whole rollout (the selector
  predicted every drafting arm slower than plain decoding).
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
FIT_TO_CHECK = (
    "a policy whose embeddings were resized (added tokens) needs a drafter with the same vocabulary "
    "(resize the drafter LM's embeddings too, or warm up a new EAGLE-3 head: `tailspec drafter warmup`); "
    "a drafter made for another model cannot draft for this one"
)


@dataclass
class DrafterHealth:
    floor: float = 0.5  # warn when the accept length falls under this x the best of the run
    best: float = 0.0  # the best accept length a rollout of the run reached (1.0 = no draft accepted)
    scores: list[float] = field(default_factory=list)
    misfit: list[str] = field(default_factory=list)  # why the drafter does not fit the policy at the last sync
    _warned: set[str] = field(default_factory=set)  # the problems warned about in their current episode

    def __post_init__(self) -> None:
        if not 0 < self.floor < 1:
            raise ValueError(f"DrafterHealth.floor must be in (0, 1), got {self.floor!r}")

    def fit(self, problems: list[str]) -> None:
        """The drafter's fit to the policy at a sync: what keeps it from drafting (empty: it fits)."""
        self.misfit = list(problems)

    def update(
        self,
        accept_length: float,
        model_drafter_steps: int,
        adaptive: bool,
    ) -> float:
        """Score one rollout: ``accept_length`` (tokens per sequence per speculative step) of its
        model-drafter steps, ``model_drafter_steps`` decode steps that drafted with the model."""
        problems: dict[str, str] = {}
        if self.misfit:
            score = 0.0
            problems["misfit"] = (
                f"the drafter does not fit the policy synced for this rollout ({'; '.join(self.misfit)}), "
                f"so it decoded without speculation; {FIT_TO_CHECK}"
            )
        elif model_drafter_steps == 0:
            score = 0.0
            if adaptive:
                problems["ruled_out"] = (
                    "strategy 'adaptive' ran none of its model-drafter arms in this rollout (the selector "
                    f"predicted them all slower than plain decoding; best accept length so far {self.best:.2f}); "
                    f"{WHAT_TO_CHECK}"
                )
        else:
            self.best = max(self.best, accept_length)
            score = (accept_length - 1) / (self.best - 1) if self.best > 1 else 1.0
            if score < self.floor:
                problems["floor"] = (
                    f"the drafter's accept length fell to {accept_length:.2f} from a best of {self.best:.2f} "
                    f"in this run (under {self.floor:.0%} of its gain); {WHAT_TO_CHECK}"
                )
        for kind, message in problems.items():
            if kind not in self._warned:
                logger.warning("drafter health: %s", message)
        self._warned = set(problems)  # one warning per episode of each problem
        self.scores.append(score)
        return score
