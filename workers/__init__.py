"""Ray rollout workers: engines in actors, a coordinator that shards rollouts over them and
trains the EAGLE-3 drafter on workers the long tail leaves idle (``coordinator.py``)."""

from .coordinator import CoordinatorEvent, RolloutCoordinator, RolloutReport, WorkersConfig, ensure_ray
from .sharding import shard_requests
from .worker import DrafterState, RolloutWorker, WorkerEvent

__all__ = [
    "CoordinatorEvent",
    "DrafterState",
    "RolloutCoordinator",
    "RolloutReport",
    "RolloutWorker",
    "WorkerEvent",
    "WorkersConfig",
    "ensure_ray",
    "shard_requests",
]
