"""``SpecRolloutConfig``: one tree that holds every setting of a :class:`SpecRollout`.

::

    SpecRolloutConfig
      engine:   RolloutConfig      (rollout/params.py: sizing, strategy, selector, mirror, kernels, ...)
      workers:  WorkersConfig      (workers/config.py: 0 = in-process; Ray placement, schedule, spot training)
      training: OnlineTrainingConfig  (the drafter's online training in the trainer's process; catch-up)
      seed, position_noise, log_metrics

Set a field by its dotted path (``SpecRollout(**{"engine.length_budget": 0.5})``, YAML's nesting,
``tailspec demo --set rollout.engine.length_budget=0.5``) or, where only one field in the tree has
that name, by the name alone (``SpecRollout(strategy="adaptive", length_budget=0.5, num_workers=2)``).
``workers=N`` is short for ``workers.num_workers=N``. Errors name the field's dotted path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..config_tree import apply_overrides, coerce_subtrees, field_paths, int_at_least, number_at_least, require
from ..drafter.catch_up import CatchUpConfig
from ..rollout.params import SEED_RANGE, RolloutConfig, valid_seed
from ..workers.config import WorkersConfig

__all__ = ["OnlineTrainingConfig", "SpecRolloutConfig", "WithRollout"]


@dataclass
class OnlineTrainingConfig:
    """The drafter's training in the trainer's process after every rollout call, so it follows the
    moving policy: an EAGLE-3 head on the features it recorded, a drafter LM on the policy's
    completions (its own weights, shipped only when they beat the drafting ones on every
    ``holdout_every``-th completion, held out, by more than ``ship_min_gain``; or its streaming heads
    if it has them, behind the same gate), ``self:L``'s exit adapter towards the policy's own
    distributions (the same gate). (With Ray workers an EAGLE-3 head, a drafter LM or its streaming
    heads trains on idle workers instead: ``workers.spot_training``.)
    ``catch_up`` raises the learning rate while the accept length has fallen far below its best
    (:mod:`tailspec.drafter.catch_up`; ``{"below": 0}`` turns it off), here and on workers alike."""

    drafter_train_steps: int = 0  # training steps after every rollout call (0: off)
    drafter_buffer_mb: int = 256  # the EAGLE-3 head's buffer of recorded features
    self_adapter_rank: int | None = None  # drafter "self:L": an ExitAdapter of this rank, trained online
    # all but an EAGLE-3 head: every n-th completion is held out to judge a trained copy (0: none), and
    # the accepted tokens per chain a trained copy must win by to ship
    holdout_every: int = 4
    ship_min_gain: float = 0.0
    catch_up: CatchUpConfig = field(default_factory=CatchUpConfig)

    def __post_init__(self) -> None:
        coerce_subtrees(self)
        if self.catch_up is None:
            self.catch_up = CatchUpConfig()
        require(
            int_at_least(self.drafter_train_steps, 0), "drafter_train_steps", "an int >= 0", self.drafter_train_steps
        )
        require(int_at_least(self.drafter_buffer_mb, 1), "drafter_buffer_mb", "an int >= 1", self.drafter_buffer_mb)
        require(
            int_at_least(self.holdout_every, 0) and self.holdout_every != 1,
            "holdout_every",
            "0 or an int >= 2",
            self.holdout_every,
        )
        require(
            number_at_least(self.ship_min_gain, 0),
            "ship_min_gain",
            "a float >= 0",
            self.ship_min_gain,
        )
        require(
            self.self_adapter_rank is None or int_at_least(self.self_adapter_rank, 1),
            "self_adapter_rank",
            "None or an int >= 1",
            self.self_adapter_rank,
        )


@dataclass
class SpecRolloutConfig:
    """TRL-style configuration of :class:`tailspec.SpecRollout` (see the module's docstring)."""

    engine: RolloutConfig = field(default_factory=RolloutConfig)
    workers: WorkersConfig = field(default_factory=lambda: WorkersConfig(num_workers=0))
    training: OnlineTrainingConfig = field(default_factory=OnlineTrainingConfig)
    seed: int | None = None  # the engines' sampling seed; None: the trainer's seed + process index
    # sample with position-keyed noise (rollout/position_noise.py): each request gets a seed derived
    # from (seed, global step, call, index), and its completion is then the same under every
    # strategy, drafter and worker layout (a run reproducible with speculation off; drafters compared
    # on one policy trajectory), at some cost in accepted draft tokens
    position_noise: bool = False
    log_metrics: bool = True  # rollout/* metrics into the trainer's logs (wandb, TensorBoard, ...)

    def __post_init__(self) -> None:
        coerce_subtrees(self)
        require(self.seed is None or valid_seed(self.seed), "seed", f"None or {SEED_RANGE}", self.seed)
        require(isinstance(self.position_noise, bool), "position_noise", "a bool", self.position_noise)
        require(isinstance(self.log_metrics, bool), "log_metrics", "a bool", self.log_metrics)
        require(
            self.engine.seed == RolloutConfig.seed,
            "engine.seed",
            "left at its default: SpecRollout seeds its engines from `seed` (None: the trainer's seed + process index)",
            self.engine.seed,
        )
        require(
            not (self.workers.num_workers and self.training.drafter_train_steps),
            "training.drafter_train_steps",
            "0 with Ray workers (workers.num_workers > 0): there the drafter's trained part (an EAGLE-3 head, "
            "a drafter LM or its streaming heads) trains on idle workers (workers.spot_training, "
            "workers.max_spot_steps)",
            self.training.drafter_train_steps,
        )
        require(
            not (self.workers.num_workers and self.training.self_adapter_rank is not None),
            "training.self_adapter_rank",
            "None with Ray workers (workers.num_workers > 0): the exit adapter drafts and trains in the "
            "trainer's process; the workers' self:L drafts without one",
            self.training.self_adapter_rank,
        )

    def engine_config(self, seed: int) -> RolloutConfig:
        """The engine's configuration with its sampling seed."""
        return replace(self.engine, seed=seed)

    @classmethod
    def takes(cls, name: str) -> bool:
        """Whether :meth:`with_overrides` takes ``name`` without a dotted path: a field's own name
        somewhere in the tree."""
        return name in field_paths(cls)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpecRolloutConfig:
        """From nested dicts (YAML); keys as :meth:`with_overrides` takes them."""
        return cls().with_overrides(**data)

    def with_overrides(self, **overrides: Any) -> SpecRolloutConfig:
        """A copy with ``overrides`` set, each named by its dotted path or by a field name that only
        one field in the tree has; ``workers=N`` is ``workers.num_workers=N``."""
        return apply_overrides(self, _short_names(overrides))


def _short_names(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``workers=N`` as ``workers.num_workers=N``; every other key as given."""
    return {"workers.num_workers" if k == "workers" and int_at_least(v, 0) else k: v for k, v in overrides.items()}


class WithRollout:
    """A config that holds a ``rollout: SpecRolloutConfig`` (the demo's, the examples'), with its
    strategy and worker count read through."""

    rollout: SpecRolloutConfig

    @property
    def strategy(self) -> str:
        """The rollout's strategy (``rollout.engine.strategy``)."""
        return self.rollout.engine.strategy

    @property
    def num_workers(self) -> int:
        """Ray rollout workers (``rollout.workers.num_workers``); 0: the in-process engine."""
        return self.rollout.workers.num_workers


class GRPORun(Protocol):
    """What a GRPO run's config (the demo's, the examples') holds for TRL's ``GRPOConfig``."""

    prompts_per_step: int
    num_generations: int
    max_completion_length: int
    temperature: float
    learning_rate: float
    beta: float
    max_steps: int
    wandb: bool
    deepspeed: str | None


def grpo_args(cfg: GRPORun, output_dir: str) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments every tailspec GRPO run sets alike: a batch of
    ``prompts_per_step x num_generations`` completions, a log line per step, no checkpoints, wandb
    when asked, DeepSpeed when named; the caller adds its device, precision and seed."""
    from .deepspeed import deepspeed_training_args

    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations,
        num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        learning_rate=cfg.learning_rate,
        beta=cfg.beta,
        max_steps=cfg.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=["wandb"] if cfg.wandb else [],
        **deepspeed_training_args(cfg.deepspeed),  # {} without DeepSpeed
    )
