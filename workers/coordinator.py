"""``RolloutCoordinator``: rollouts over worker actors, with TLT-style spot drafter training on
workers that the long tail leaves idle. The workers are Ray actors (``backend="ray"``, one process
each, anywhere on the cluster) or threads of this process (``backend="threads"``: no cluster, for
one machine and for debugging); :mod:`tailspec.actors` hides which. The pieces, each in its own
module:

- **Dealing** (``work_queue.py``, ``length_predictor.py``): ``divided`` (default) keeps one global
  queue that workers pull 4-request chunks from whenever their engine has room, longest-predicted
  first (a prompt's siblings finished so far and its lengths in recent rollouts); ``static`` cuts
  one shard per worker, prompt groups together (``sharding.py``).
- **The rollout round** (``rollout_round.py``): each worker runs a serving session that new chunks
  join (continuous batching across chunks) and streams its outputs as its requests finish; a
  worker that runs dry takes every second request of the busiest one (released mid-way and
  continued, tokens not K/V); the coordinator waits for whichever stream (or training chunk) is
  ready next.
- **Faults** (``ledger.py``, ``pool.py``): a worker that dies mid-rollout costs only the requests
  it had not finished: they are re-run on the others (the dead worker is replaced when none is
  left), finished ones are kept, every request is counted once and results come back in order.
  A worker that dies while training costs only its running chunk. Dead workers are replaced
  before the next rollout.
- **Spot training** (``spot.py``): while a worker has drained and others still generate, it runs
  chunks of drafter-training steps on the freshest recorded data, starting from the
  coordinator's newest drafter state, and returns the new state (optimizer included). A chunk
  is told to stop when work arrives for its worker or the rollout ends; it yields at its next
  step boundary and is collected whenever it returns: neither the rollout's results nor the
  next rollout wait for it (the next rollout starts on the other workers and gives the trainer
  work when the chunk is in).
- **Placement** (``pool.py``): workers that do not start within ``placement_timeout_s`` raise
  ``PlacementError`` naming the CPUs/GPUs asked for and what the cluster has free.

Versions. Policy weights are pushed with :meth:`RolloutCoordinator.sync_policy` once per version
(one object-store put every worker reads); after a rollout the newest drafter state goes to every
worker (in :meth:`RolloutCoordinator.settle`, before the next rollout), so all workers draft with
one version per rollout, and the driver's head object follows. A worker still training when new
weights or a new drafter version go out gets them with its next shard.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..actors import ActorDied, actors_for, ray_module
from ..config_tree import require
from ..drafter.eagle3 import Eagle3Head
from ..drafter.online_training import DrafterState, TrainedPart
from ..drafter.part_learning import learner_for
from ..rollout.adaptive.acceptance import AcceptanceBook
from ..rollout.admission import RequestLimits, prepare_requests
from ..rollout.params import RolloutConfig, SamplingParams
from ..rollout.request import RequestOutput
from ..rollout.stats import EngineCounts
from .config import WorkersConfig
from .length_predictor import LengthPredictor
from .pool import PlacementError, WorkerPool
from .rollout_round import RolloutRound, SchedulePlan, Versions, collect_chunk
from .sharding import shard_requests
from .spot import SpotTraining
from .worker import RolloutWorker

__all__ = [
    "CoordinatorEvent",
    "PlacementError",
    "RolloutCoordinator",
    "RolloutReport",
    "WorkersConfig",
    "ensure_ray",
    "shard_requests",
]

logger = logging.getLogger(__name__)

# how long a rollout's start waits for the training chunk still out since the last one ended (told to
# stop then, it yields within one training step): back in time, its worker gets its share of the
# rollout instead of joining late on work moved to it
STOPPED_CHUNK_WAIT_S = 5.0


@dataclass
class CoordinatorEvent:
    seq: int
    kind: str  # shard | submit | finished | move_asked | released | shard_done | worker_died | rerun | spot_* | ...
    worker: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.perf_counter)


@dataclass
class RolloutReport:
    """What one :meth:`RolloutCoordinator.generate` call did, summed over workers."""

    outputs: list[RequestOutput]
    counts: EngineCounts  # what the engines counted, summed over the workers
    seconds: float
    spot_steps: int  # training steps collected since the last report (a chunk still stopping counts next call)
    spot_losses: list[float]
    drafter_version: int | None  # the drafting head's (shipped) version
    policy_version: int
    workers_died: int
    requests_rerun: int = 0  # unfinished requests of dead workers, generated again
    requests_moved: int = 0  # requests continued on another worker (tail rebalancing)
    length_error: float = float("nan")  # mean |predicted - actual| / actual of predicted lengths
    spot_shipped: int = 0  # training chunks whose head became the drafting one
    spot_held: int = 0  # chunks kept back (no better than the drafting head on held-out samples)
    spot_held_out: list[tuple[float, float]] = field(default_factory=list)  # (drafting, trained) per chunk
    idle_worker_s: float = 0.0  # worker-seconds without requests while another worker generated
    spot_busy_s: float = 0.0  # of those, the seconds a spot training chunk ran


def ensure_ray(address: str | None = None, num_cpus: float | None = None) -> bool:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a new local Ray instance;
    True when this call started one (nothing happens when Ray is already initialized here).

    Without an address a new instance is started even when some other Ray cluster runs on this
    machine (Ray's default would join the latest one started here, and refuse ``num_cpus``).
    """
    ray = ray_module()

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": True}
    if address is None:
        kwargs.update(include_dashboard=False, num_cpus=num_cpus)
        logger.info("starting a local Ray instance (%s CPUs)", num_cpus)
    else:
        logger.info("joining the Ray cluster at %s", address)
    ray.init(address=address or "local", **kwargs)
    return address is None


class RolloutCoordinator:
    def __init__(
        self,
        model: torch.nn.Module,
        rollout_config: RolloutConfig,
        eos_token_ids: Sequence[int],
        drafter: Any = None,
        config: WorkersConfig | None = None,
        training: Any = None,
        policy_version: int = 0,
        on_event: Callable[[CoordinatorEvent], None] | None = None,
    ) -> None:
        self.on_event = on_event  # called with every event as it is recorded (logging, tests)
        self.config = c = config or WorkersConfig()
        require(
            c.num_workers >= 1,
            "num_workers",
            "an int >= 1 for a coordinator (0 is the in-process engine)",
            c.num_workers,
        )
        gpus = c.num_gpus_per_worker
        self.num_gpus = gpus if gpus is not None else (1.0 if torch.cuda.is_available() else 0.0)
        cpus = max(os.cpu_count() or 1, c.num_workers * c.num_cpus_per_worker)
        self.actors = actors_for(c.backend)
        # stopped on an interrupt (shutdown)
        self.started_ray = c.backend == "ray" and ensure_ray(c.address, num_cpus=cpus)
        self.rollout_config = rollout_config
        self.eos_token_ids = list(eos_token_ids)
        self.limits = RequestLimits.of(model, rollout_config)
        self.training = training
        # what spot training trains (an EAGLE-3 head, a drafter LM's weights; None: nothing); the
        # driver's copy follows every broadcast version (for checkpoints and export)
        learning = learner_for(drafter, model, training)
        self.part: TrainedPart | None = learning[0] if learning is not None else None
        self.events: list[CoordinatorEvent] = []
        self.spot = self._spot_training(c)
        self.policy_version = policy_version
        self._model_ref = self.actors.put(model)
        self._model_version = policy_version  # the weights in _model_ref
        self._drafter_ref = self.actors.put(drafter) if drafter is not None else None
        self._policy_state_ref = None  # the newest weights once sync_policy ran
        self._drafter_state_ref: tuple[int, Any] | None = None  # (version, ref) of the last state put
        self._needs_broadcast = False
        self.pool = WorkerPool(
            self.actors,
            self._create_actor,
            self._ready_actor,
            self._event,
            placement_timeout_s=c.placement_timeout_s,
            describe_request=lambda n: f"CPU {n * c.num_cpus_per_worker:g}, GPU {n * self.num_gpus:g}",
        )
        self.predictor = LengthPredictor(window=c.length_history)
        self.pool.fill(c.num_workers)

    def _spot_training(self, c: WorkersConfig) -> SpotTraining:
        """Spot training of ``self.part`` (nothing to train: a state of None) on idle workers."""
        return SpotTraining(
            DrafterState.of(self.part) if self.part is not None else None,
            actors=self.actors,
            enabled=c.spot_training,
            steps_per_chunk=c.spot_steps_per_call,
            max_steps_per_rollout=c.max_spot_steps,
            buffer_bytes=c.sample_buffer_mb << 20,
            event=self._event,
            holdout_every=c.spot_holdout_every,
            ship_min_gain=c.spot_ship_min_gain,
        )

    @property
    def workers(self) -> dict[int, Any]:
        """Live worker actors by index."""
        return self.pool.workers

    @property
    def drafter_state(self) -> DrafterState | None:
        """The drafting part's state (what the next rollout drafts with; spot training may hold a
        newer trained one that has not earned shipping yet)."""
        return self.spot.shipped

    # -- workers -------------------------------------------------------------------------------
    def _create_actor(self, index: int) -> Any:
        cfg = RolloutConfig.from_dict({**self.rollout_config.__dict__, "seed": self.rollout_config.seed + 1000 * index})
        c = self.config
        # threads share this process's torch settings: a worker leaves them as they are
        threads = c.threads_per_worker if c.backend == "ray" else None
        return self.actors.spawn(
            RolloutWorker,
            index,
            self._model_ref,
            cfg,
            self.eos_token_ids,
            self._drafter_ref,
            self.drafter_state,
            self.training,
            self._model_version,
            threads,
            self.actors,
            num_cpus=c.num_cpus_per_worker,
            num_gpus=self.num_gpus,
            max_concurrency=4,
        )

    def _ready_actor(self, index: int, actor: Any) -> tuple[int, int | None]:
        """Bring a started actor up to date: the newest policy weights (it was built from the first)."""
        policy = self._model_version
        if self._policy_state_ref is not None and policy != self.policy_version:
            self.actors.get(self.actors.call(actor, "set_policy", self._policy_state_ref, self.policy_version))
            policy = self.policy_version
        state = self.drafter_state  # what it was built with
        return policy, state.version if state is not None else None

    def _event(self, kind: str, worker: int | None = None, **detail: Any) -> None:
        event = CoordinatorEvent(len(self.events), kind, worker, detail)
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def replace_dead_workers(self) -> None:
        self.pool.fill(self.config.num_workers)

    def worker_versions(self) -> dict[int, tuple[int, int | None]]:
        self.settle()
        return {i: self.actors.get(self.actors.call(w, "versions")) for i, w in self.workers.items()}

    def worker_events(self) -> dict[int, list]:
        self.settle()
        return {i: self.actors.get(self.actors.call(w, "events")) for i, w in self.workers.items()}

    def shutdown(self, *, wait: bool = True, stop_ray: bool = False) -> None:
        """Stop the workers. ``wait``: first collect a training chunk still stopping (so no trained
        state is lost); ``wait=False`` (an interrupt) kills them at once. ``stop_ray``: also stop
        the local Ray instance if this coordinator started it."""
        if wait:
            self.settle()
        self.pool.kill_all()
        if stop_ray and self.started_ray:
            ray = ray_module()

            if ray.is_initialized():
                ray.shutdown()

    # -- policy weights ------------------------------------------------------------------------
    def sync_policy(self, model: torch.nn.Module, version: int) -> bool:
        """Send ``model``'s weights to every worker unless they already have ``version``. A worker
        still training gets them with its next shard (the sync does not wait for it)."""
        self.settle(wait=False)
        if version == self.policy_version:
            return False
        state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        self._policy_state_ref = self.actors.put(state)
        self.policy_version = version
        for index in self.pool.call_all("set_policy", self._policy_state_ref, version, skip=self.spot.training_worker):
            self.pool.set_held(index, policy=version)
        self._event("policy_sync", version=version)
        return True

    # -- one rollout -----------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> RolloutReport:
        prompts, per_request = prepare_requests(prompts, params, self.limits)
        self.settle(wait=STOPPED_CHUNK_WAIT_S)
        if self.config.respawn_dead_workers:
            self.replace_dead_workers()
        if not self.workers:
            raise RuntimeError("no live rollout workers (respawn_dead_workers is off)")
        start = time.perf_counter()
        self.predictor.begin_rollout()
        round_ = RolloutRound(
            prompts,
            per_request,
            pool=self.pool,
            spot=self.spot,
            versions=self._versions(),
            plan=SchedulePlan.of(self.config, self.rollout_config.max_num_seqs),
            predictor=self.predictor,
            max_attempts=self.config.max_shard_attempts,
            respawn=self.config.respawn_dead_workers,
            event=self._event,
            draft_hosts=self.config.draft_hosts,
            train_in_gap=self.config.spot_in_update_gap,
        )
        result = round_.run()
        self._pool_acceptance()
        self._needs_broadcast = self.drafter_state is not None
        tally = self.spot.take_tally()
        return RolloutReport(
            outputs=result.outputs,
            counts=result.counts,
            seconds=time.perf_counter() - start,
            spot_steps=tally.steps,
            spot_losses=tally.losses,
            spot_shipped=tally.shipped,
            spot_held=tally.held,
            spot_held_out=tally.held_out,
            drafter_version=self.drafter_state.version if self.drafter_state is not None else None,
            policy_version=self.policy_version,
            workers_died=result.died + tally.died,
            requests_rerun=result.rerun,
            requests_moved=result.moved,
            idle_worker_s=result.idle_worker_s,
            spot_busy_s=result.spot_busy_s,
            length_error=self.predictor.log.mean_rel_error,
        )

    def _pool_acceptance(self) -> None:
        """Every worker's adaptive selector adopts the average of the workers' acceptance books, so
        what one worker's drafts measured informs the others' next rollout (the worker training
        spot steps is left out: it is busy, and gets the next average)."""
        skip = self.spot.training_worker
        books = []
        for index, actor in list(self.workers.items()):
            if index == skip:
                continue
            try:
                book = self.actors.get(self.actors.call(actor, "acceptance_book"))
            except ActorDied as e:
                self.pool.mark_dead(index, e)
                continue
            if book is not None:
                books.append(book)
        if len(books) > 1:
            self.pool.call_all("merge_acceptance", AcceptanceBook.merged(books), skip=skip)

    def _versions(self) -> Versions:
        """The versions this rollout generates with: the newest policy and drafter state."""

        state = self.drafter_state
        return Versions(
            policy=self.policy_version,
            policy_ref=self._policy_state_ref,
            drafter=state.version if state is not None else None,
            drafter_ref=self._drafter_ref_of(state) if state is not None else None,
        )

    def _drafter_ref_of(self, state: DrafterState) -> Any:
        """``state`` in the object store, put once per version (the broadcast and every shard share it)."""
        if self._drafter_state_ref is None or self._drafter_state_ref[0] != state.version:
            self._drafter_state_ref = (state.version, self.actors.put(state))
        return self._drafter_state_ref[1]

    def settle(self, *, wait: bool | float = True) -> None:
        """Finish what a rollout left: collect the training chunk still out when it ended (one
        training through the update gap, or one told to stop), then send the newest drafter state
        to every worker not training. ``wait=False``: only if the chunk has already returned;
        otherwise it is told to stop first and waited for (a number: at most that many seconds;
        the next rollout collects it if it is late). Called before a policy sync (not waiting),
        before the next rollout (waiting briefly, see ``STOPPED_CHUNK_WAIT_S``) and before version
        queries, checkpoints and shutdown (waiting), so drafter training overlaps the trainer's
        optimizer step."""
        chunk = self.spot.running
        if chunk is not None and wait is not False and chunk.worker in self.pool.workers:
            self.spot.stop(self.pool.workers[chunk.worker], rollout_over=True)  # e.g. one training through the gap
        if chunk is not None and wait is not True:
            waited = time.perf_counter()
            back = bool(self.actors.wait([chunk.ref], num_returns=1, timeout=float(wait))[0])
            if wait:
                self._event("chunk_awaited", chunk.worker, seconds=round(time.perf_counter() - waited, 3), back=back)
        if chunk is not None and (wait is True or back):
            collect_chunk(self.spot, self.pool)
            self._needs_broadcast = True
        if self._needs_broadcast and self.drafter_state is not None:
            self._needs_broadcast = self.spot.running is not None  # the trainer still needs it
            self._broadcast_drafter()

    def state_dict(self) -> dict[str, Any]:
        """What the workers and the coordinator learned, for a checkpoint: each worker's engine
        state (selector, suffix history), the length predictor, and the newest drafter state
        (weights, optimizer, step, version; None without a trained part). Waits for a training
        chunk still stopping, so no trained state is left out."""
        self.settle()
        engines = {i: self.actors.get(self.actors.call(w, "engine_state")) for i, w in sorted(self.workers.items())}
        trained = self.spot.state
        return {
            "engines": list(engines.values()),
            "predictor": self.predictor.state_dict(),
            "drafter": self.drafter_state,
            # spot training's newest state where it has not been shipped (optimizer included)
            "drafter_trained": trained if trained is not self.drafter_state else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: worker ``k`` gets engine state ``k`` (cycled when the
        worker count changed), the drafter state becomes the newest (optimizer included) and goes
        to every worker."""
        engines = state.get("engines") or []
        if engines:
            workers = list(self.pool.workers.values())
            self.actors.get(
                [self.actors.call(w, "load_engine_state", engines[k % len(engines)]) for k, w in enumerate(workers)]
            )
        if state.get("predictor") is not None:
            self.predictor.load_state_dict(state["predictor"])
        drafter = state.get("drafter")
        if drafter is not None:
            if self.part is None:
                raise ValueError(
                    "the saved rollout state has a drafter state but this coordinator drafts with no trained part "
                    "(an EAGLE-3 head or a drafter LM)"
                )
            self.settle()
            self.spot.publish(drafter)
            if state.get("drafter_trained") is not None:
                self.spot.resume_training_from(state["drafter_trained"])
            self._needs_broadcast = True
            self.settle()

    def set_drafter_lr_scale(self, scale: float) -> None:
        """Spot training chunks from now on run at ``scale`` times the learning rate (catch-up)."""
        self.spot.lr_scale = float(scale)

    def publish_drafter(self, head: Eagle3Head) -> None:
        """Make ``head`` (trained outside the workers, e.g. by ``DrafterFromTrainer`` in the
        trainer process) the drafter every worker uses from the next rollout on. Spot training, if
        on, continues from it; the workers' optimizer states belong to the replaced version."""
        if not isinstance(self.part, Eagle3Head):
            raise ValueError("this coordinator drafts with no EAGLE-3 head; there is nothing to replace")
        # taken first: settling broadcasts the version it replaces, which loads that version into the
        # coordinator's head, and that is ``head`` itself when the trainer trains the drafting head
        published = DrafterState.of(head)
        self.settle()  # a training chunk that finished meanwhile must not overwrite the new state
        self.spot.publish(published)
        published.load_into(self.part)  # back in the trainer's head at once (the broadcast follows)
        self._needs_broadcast = True
        self._event("drafter_published", version=self.drafter_state.version)

    def _broadcast_drafter(self) -> None:
        """Every worker not training drafts with the newest version from the next rollout on; the
        driver's part follows too (for checkpoints and export)."""
        state = self.drafter_state
        state_ref = self._drafter_ref_of(state)
        for index in self.pool.call_all("set_drafter", state_ref, skip=self.spot.training_worker):
            self.pool.set_held(index, drafter=state.version)
        state.load_into(self.part)
        self._event("drafter_broadcast", version=state.version)
