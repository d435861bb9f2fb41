"""TRL glue: the rollout callable and the GRPOTrainer subclass."""

from .sampling_from_trl import sampling_params_from_trl
from .spec_rollout import RolloutStats, SpecRollout, SpecRolloutConfig

__all__ = ["RolloutStats", "SpecRollout", "SpecRolloutConfig", "sampling_params_from_trl"]
