"""TRL glue: the rollout callable and the GRPOTrainer subclass."""

from .config import OnlineTrainingConfig, SpecRolloutConfig
from .sampling_from_trl import sampling_params_from_trl
from .spec_rollout import RolloutStats, SpecRollout

__all__ = ["OnlineTrainingConfig", "RolloutStats", "SpecRollout", "SpecRolloutConfig", "sampling_params_from_trl"]
