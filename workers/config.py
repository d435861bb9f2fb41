"""The Ray rollout workers' configuration (a subtree of ``SpecRolloutConfig``: ``workers``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..actors import BACKENDS
from ..config_tree import int_at_least, number_at_least, require
from .work_queue import ORDERS, SCHEDULES


def _none_or_int_at_least(value, low: int) -> bool:
    return value is None or int_at_least(value, low)


@dataclass
class WorkersConfig:
    """How many rollout workers, where, how a rollout is dealt to them, and how they train the
    drafter in the tail. ``num_workers=0`` is no workers: :class:`tailspec.SpecRollout` then runs
    its engine in the trainer's process (the coordinator itself needs at least one)."""

    num_workers: int = 2
    # where the workers run (tailspec.actors): "ray" (Ray actors, a process each, on the cluster at
    # ``address``) or "threads" (threads of this process: no cluster, no placement, the cores shared;
    # for one machine and for debugging)
    backend: str = "ray"
    address: str | None = None  # Ray address to join; None: RAY_ADDRESS if set, else start a local Ray
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float | None = None  # None: 1 when CUDA is available, else 0
    threads_per_worker: int | None = 1  # torch intra-op threads in each worker (None: leave as is)
    spot_training: bool = True  # an EAGLE-3 head or a drafter LM (no streaming heads) trains on idle workers
    spot_steps_per_call: int = 4  # steps per training chunk (the coordinator can stop a chunk early)
    max_spot_steps: int = 256  # per rollout
    # when a rollout ends, a worker trains the head on while the trainer updates the policy (rollout
    # workers wait then; free where they have accelerators of their own, taken from the trainer
    # where they share its cores); the next rollout stops it first and waits for it (one step)
    spot_in_update_gap: bool = True
    # every n-th recorded sample a training worker gets is held out (0: none); a trained head is
    # shipped to the engines only when it beats the drafting one there by more than the gain
    # (accepted draft tokens per chain)
    spot_holdout_every: int = 4
    spot_ship_min_gain: float = 0.0
    sample_buffer_mb: int = 256  # the coordinator's buffer of recorded training data
    respawn_dead_workers: bool = True
    max_shard_attempts: int = 3  # a request whose workers keep dying fails the rollout after this many tries
    # how a rollout is dealt (tailspec.workers.work_queue): "divided" (a global queue that workers
    # pull chunks from as they have room) or "static" (one fixed shard per worker, groups together)
    schedule: str = "divided"
    order: str = "predicted"  # "predicted": longest-predicted first (after one probe per new prompt) | "fifo"
    chunk_size: int = 4  # requests per pull
    inflight_per_worker: int | None = None  # requests a worker holds at once; None: its engine's max_num_seqs
    rebalance: bool = True  # move requests from a busy worker to one that ran dry (tail rebalancing)
    rebalance_min_tokens: int = 32  # only requests predicted at least this long are moved
    length_history: int = 4  # rollouts of per-prompt completion lengths kept for length prediction
    placement_timeout_s: float | None = 120.0  # fail (naming asked vs free resources) if workers cannot start
    # Mirror-SD across workers (workers/draft_hosts.py): a worker idle in the tail drafts the mirror
    # branches of one still decoding (before spot training takes it); needs a mirror strategy (or
    # adaptive with mirror arms) and a drafter LM
    draft_hosts: bool = False

    def __post_init__(self) -> None:
        for name, ok, allowed in self._placement_checks() + self._training_checks() + self._schedule_checks():
            require(ok, name, allowed, getattr(self, name))

    def _placement_checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("num_workers", int_at_least(self.num_workers, 0), "an int >= 0 (0: no workers, the in-process engine)"),
            ("backend", self.backend in BACKENDS, f"one of {BACKENDS}"),
            ("num_cpus_per_worker", number_at_least(self.num_cpus_per_worker, 0), "a number >= 0"),
            (
                "num_gpus_per_worker",
                self.num_gpus_per_worker is None or number_at_least(self.num_gpus_per_worker, 0),
                "None or a number >= 0",
            ),
            ("threads_per_worker", _none_or_int_at_least(self.threads_per_worker, 1), "None or an int >= 1"),
            ("respawn_dead_workers", isinstance(self.respawn_dead_workers, bool), "a bool"),
            ("max_shard_attempts", int_at_least(self.max_shard_attempts, 1), "an int >= 1"),
            (
                "placement_timeout_s",
                self.placement_timeout_s is None
                or (number_at_least(self.placement_timeout_s, 0) and self.placement_timeout_s > 0),
                "None or a number > 0",
            ),
            ("draft_hosts", isinstance(self.draft_hosts, bool), "a bool"),
        ]

    def _training_checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("spot_training", isinstance(self.spot_training, bool), "a bool"),
            ("spot_steps_per_call", int_at_least(self.spot_steps_per_call, 1), "an int >= 1"),
            ("max_spot_steps", int_at_least(self.max_spot_steps, 0), "an int >= 0"),
            ("spot_in_update_gap", isinstance(self.spot_in_update_gap, bool), "a bool"),
            (
                "spot_holdout_every",
                int_at_least(self.spot_holdout_every, 0) and self.spot_holdout_every != 1,
                "0 or an int >= 2",
            ),
            ("spot_ship_min_gain", number_at_least(self.spot_ship_min_gain, 0), "a float >= 0"),
            ("sample_buffer_mb", int_at_least(self.sample_buffer_mb, 1), "an int >= 1"),
        ]

    def _schedule_checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("schedule", self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
            ("order", self.order in ORDERS, f"one of {ORDERS}"),
            ("chunk_size", int_at_least(self.chunk_size, 1), "an int >= 1"),
            ("inflight_per_worker", _none_or_int_at_least(self.inflight_per_worker, 1), "None or an int >= 1"),
            ("rebalance", isinstance(self.rebalance, bool), "a bool"),
            ("rebalance_min_tokens", int_at_least(self.rebalance_min_tokens, 0), "an int >= 0"),
            ("length_history", int_at_least(self.length_history, 0), "an int >= 0"),
        ]
