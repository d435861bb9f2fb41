"""Ray rollout workers: engines in actors, a coordinator that shards rollouts over them and
trains the EAGLE-3 drafter on workers the long tail leaves idle (``coordinator.py``)."""

from ..drafter.online_training import DrafterState
from .config import WorkersConfig
from .coordinator import CoordinatorEvent, PlacementError, RolloutCoordinator, RolloutReport, ensure_ray
from .sharding import shard_requests
from .worker import RolloutWorker, WorkerEvent

__all__ = [
    "CoordinatorEvent",
    "DrafterState",
    "PlacementError",
    "RolloutCoordinator",
    "RolloutReport",
    "RolloutWorker",
    "WorkerEvent",
    "WorkersConfig",
    "ensure_ray",
    "shard_requests",
]
