"""``RolloutCoordinator``: rollouts sharded over Ray workers, with TLT-style spot drafter
training on workers that the long tail leaves idle.

One rollout call:

1. **Shard.** Requests are grouped by identical prompt (a GRPO group stays on one worker, so it
   is prefilled once and its suffix drafter sees the siblings) and groups are dealt to the live
   workers, largest first, to the least loaded one.
2. **Generate.** Every worker runs its shard through its own engine. The coordinator waits for
   whichever call finishes next.
3. **Spot training.** When a worker has drained while others are still generating, and the
   drafter is an EAGLE-3 head, the worker gets a chunk of drafter-training steps on the freshest
   buffered data (recorded by all workers, newest kept under a byte cap), starting from the
   coordinator's last drafter state. One worker trains at a time, chunk after chunk, while the
   rollout lasts; it is told to stop (it yields before its next step) as soon as the last shard
   is done or a re-run shard needs a worker. Each chunk returns the new state, so the coordinator
   always holds the newest version, optimizer state included. The rollout's results return at
   once; the chunk that was stopping is collected by :meth:`RolloutCoordinator.settle` before
   anything else touches the workers, so its last step overlaps the trainer's optimizer step.
4. **Faults.** A worker that dies mid-rollout has its whole shard re-run on the others (a shard's
   results only come back complete), so every prompt still gets exactly one completion, in
   order; a worker that dies while training costs only its running chunk: training resumes from
   the last state the coordinator holds. Dead workers are replaced before the next rollout.
5. **Broadcast.** After the rollout (in :meth:`RolloutCoordinator.settle`, before the next
   rollout, policy sync or version query) the newest drafter state goes to every worker, so all
   workers always draft with the same version, and the driver's head object follows.

Policy weights are pushed with :meth:`sync_policy` once per version (the trainer's global
step): one ``ray.put`` that every worker reads.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..drafter.eagle3 import Eagle3Head
from ..drafter.eagle3.data import Eagle3Sample
from ..drafter.eagle3.train import DrafterTrainingConfig
from ..rollout.engine import RequestLimits, prepare_requests
from ..rollout.params import RolloutConfig, SamplingParams
from ..rollout.request import RequestOutput
from .worker import STAT_KEYS, DrafterState, GenerateResult, RolloutWorker, TrainResult

logger = logging.getLogger(__name__)


@dataclass
class WorkersConfig:
    """How many rollout workers, where, and how they train the drafter in the tail."""

    num_workers: int = 2
    address: str | None = None  # Ray address to join; None: RAY_ADDRESS if set, else start a local Ray
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float | None = None  # None: 1 when CUDA is available, else 0
    threads_per_worker: int | None = 1  # torch intra-op threads in each worker (None: leave as is)
    spot_training: bool = True  # EAGLE-3 heads only
    spot_steps_per_call: int = 4  # steps per training chunk (the coordinator can stop a chunk early)
    max_spot_steps: int = 256  # per rollout
    sample_buffer_mb: int = 256  # the coordinator's buffer of recorded training data
    respawn_dead_workers: bool = True
    max_shard_attempts: int = 3  # a shard whose workers keep dying fails the rollout after this many tries

    def __post_init__(self) -> None:
        checks = [
            ("num_workers", isinstance(self.num_workers, int) and self.num_workers >= 1, "an int >= 1"),
            ("num_cpus_per_worker", self.num_cpus_per_worker >= 0, "a number >= 0"),
            (
                "num_gpus_per_worker",
                self.num_gpus_per_worker is None or self.num_gpus_per_worker >= 0,
                "None or a number >= 0",
            ),
            (
                "threads_per_worker",
                self.threads_per_worker is None
                or (isinstance(self.threads_per_worker, int) and self.threads_per_worker >= 1),
                "None or an int >= 1",
            ),
            (
                "spot_steps_per_call",
                isinstance(self.spot_steps_per_call, int) and self.spot_steps_per_call >= 1,
                "an int >= 1",
            ),
            ("max_spot_steps", isinstance(self.max_spot_steps, int) and self.max_spot_steps >= 0, "an int >= 0"),
            ("sample_buffer_mb", isinstance(self.sample_buffer_mb, int) and self.sample_buffer_mb >= 1, "an int >= 1"),
            (
                "max_shard_attempts",
                isinstance(self.max_shard_attempts, int) and self.max_shard_attempts >= 1,
                "an int >= 1",
            ),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"WorkersConfig.{name} must be {allowed}, got {getattr(self, name)!r}")


@dataclass
class CoordinatorEvent:
    seq: int
    kind: str  # shard | shard_done | worker_died | rerun | spot_start | spot_done | spot_stop | rollout_end | ...
    worker: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutReport:
    """What one :meth:`RolloutCoordinator.generate` call did, summed over workers."""

    outputs: list[RequestOutput]
    stats: dict[str, float]  # engine counters (STAT_KEYS), summed
    strategy_steps: dict[str, int]
    seconds: float
    spot_steps: int  # chunks finished during this call (one still stopping at its end counts next call)
    spot_losses: list[float]
    drafter_version: int | None
    policy_version: int
    workers_died: int


@dataclass
class _Tally:
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    died: int = 0


@dataclass
class _Shard:
    indices: list[int]
    attempts: int = 0


def ensure_ray(address: str | None = None, num_cpus: float | None = None) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a new local Ray instance.

    Without an address a new instance is started even when some other Ray cluster runs on this
    machine (Ray's default would join the latest one started here, and refuse ``num_cpus``).
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": True}
    if address is None:
        kwargs.update(include_dashboard=False, num_cpus=num_cpus)
        logger.info("starting a local Ray instance (%s CPUs)", num_cpus)
    else:
        logger.info("joining the Ray cluster at %s", address)
    ray.init(address=address or "local", **kwargs)


def shard_requests(prompts: Sequence[Sequence[int]], num_shards: int) -> list[list[int]]:
    """Request indices per shard: identical prompts stay together; groups go largest first to the
    least loaded shard (load = requests)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(shards, key=len).extend(members)
    return [sorted(s) for s in shards if s]


class RolloutCoordinator:
    def __init__(
        self,
        model: torch.nn.Module,
        rollout_config: RolloutConfig,
        eos_token_ids: Sequence[int],
        drafter: Any = None,
        config: WorkersConfig | None = None,
        training: DrafterTrainingConfig | None = None,
        policy_version: int = 0,
        on_event: Callable[[CoordinatorEvent], None] | None = None,
    ) -> None:
        import ray

        self.on_event = on_event  # called with every event as it is recorded (logging, tests)
        self.config = config or WorkersConfig()
        c = self.config
        gpus = c.num_gpus_per_worker
        self.num_gpus = gpus if gpus is not None else (1.0 if torch.cuda.is_available() else 0.0)
        ensure_ray(c.address, num_cpus=max(os.cpu_count() or 1, c.num_workers * c.num_cpus_per_worker))
        self.rollout_config = rollout_config
        self.eos_token_ids = list(eos_token_ids)
        self.limits = RequestLimits.of(model, rollout_config)
        self.training = training
        self.head = drafter if isinstance(drafter, Eagle3Head) else None
        self.drafter_state = DrafterState.of(self.head) if self.head is not None else None
        self.policy_version = policy_version
        self._model_ref = ray.put(model)
        self._drafter_ref = ray.put(drafter) if drafter is not None else None
        self._policy_state_ref = None  # the newest weights once sync_policy ran
        self._actor_cls = ray.remote(num_cpus=c.num_cpus_per_worker, num_gpus=self.num_gpus, max_concurrency=2)(
            RolloutWorker
        )
        self._next_index = 0
        self.workers: dict[int, Any] = {}
        self.samples: deque[tuple[int, Eagle3Sample]] = deque()  # (id, sample), oldest first
        self._sample_bytes = 0
        self._next_sample_id = 0
        self._sent_upto: dict[int, int] = {}  # worker -> highest sample id it has been sent
        self._trainer_holds: dict[int, int] = {}  # worker -> drafter version its own trainer holds
        self.events: list[CoordinatorEvent] = []
        self._pending_training: tuple[Any, int] | None = None  # a chunk still stopping after its rollout
        self._needs_broadcast = False
        self._tally = _Tally()
        for _ in range(c.num_workers):
            self._spawn()
        ray.get([w.ping.remote() for w in self.workers.values()])

    # -- workers -------------------------------------------------------------------------------
    def _spawn(self) -> int:
        import ray

        index = self._next_index
        self._next_index += 1
        cfg = RolloutConfig.from_dict({**self.rollout_config.__dict__, "seed": self.rollout_config.seed + 1000 * index})
        actor = self._actor_cls.remote(
            index,
            self._model_ref,
            cfg,
            self.eos_token_ids,
            self._drafter_ref,
            self.drafter_state,
            self.training,
            self.policy_version,
            self.config.threads_per_worker,
        )
        if self._policy_state_ref is not None:
            ray.get(actor.set_policy.remote(self._policy_state_ref, self.policy_version))
        self.workers[index] = actor
        self._event("spawn", index)
        return index

    def _event(self, kind: str, worker: int | None = None, **detail: Any) -> None:
        event = CoordinatorEvent(len(self.events), kind, worker, detail)
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def _mark_dead(self, index: int, error: BaseException) -> None:
        logger.warning("rollout worker %d died: %s", index, error)
        self.workers.pop(index, None)
        self._sent_upto.pop(index, None)
        self._trainer_holds.pop(index, None)
        self._event("worker_died", index, error=type(error).__name__)

    def replace_dead_workers(self) -> None:
        while len(self.workers) < self.config.num_workers:
            index = self._spawn()
            logger.info("started rollout worker %d to replace a dead one", index)

    def worker_versions(self) -> dict[int, tuple[int, int | None]]:
        import ray

        self.settle()
        return {i: ray.get(w.versions.remote()) for i, w in self.workers.items()}

    def worker_events(self) -> dict[int, list]:
        import ray

        self.settle()
        return {i: ray.get(w.events.remote()) for i, w in self.workers.items()}

    def shutdown(self) -> None:
        """Settle pending drafter work (so no trained state is lost), then stop the workers."""
        import ray

        self.settle()
        for w in self.workers.values():
            ray.kill(w)
        self.workers.clear()

    # -- policy weights ------------------------------------------------------------------------
    def sync_policy(self, model: torch.nn.Module, version: int) -> bool:
        """Send ``model``'s weights to every worker unless they already have ``version``."""
        import ray

        self.settle()
        if version == self.policy_version:
            return False
        state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        self._policy_state_ref = ray.put(state)
        self.policy_version = version
        for index, worker in list(self.workers.items()):
            try:
                ray.get(worker.set_policy.remote(self._policy_state_ref, version))
            except ray.exceptions.RayActorError as e:
                self._mark_dead(index, e)
        self._event("policy_sync", version=version)
        return True

    # -- training data ---------------------------------------------------------------------------
    def _add_samples(self, samples: list[Eagle3Sample]) -> None:
        cap = self.config.sample_buffer_mb << 20
        for s in samples:
            if s.nbytes > cap:
                continue
            self.samples.append((self._next_sample_id, s))
            self._next_sample_id += 1
            self._sample_bytes += s.nbytes
            while self._sample_bytes > cap:
                self._sample_bytes -= self.samples.popleft()[1].nbytes

    # -- one rollout -----------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> RolloutReport:
        import ray

        prompts, per_request = prepare_requests(prompts, params, self.limits)
        self.settle()
        if self.config.respawn_dead_workers:
            self.replace_dead_workers()
        if not self.workers:
            raise RuntimeError("no live rollout workers (respawn_dead_workers is off)")
        start = time.perf_counter()
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        stats = dict.fromkeys(STAT_KEYS, 0.0)
        strategy_steps: dict[str, int] = {}
        waiting: deque[_Shard] = deque(_Shard(s) for s in shard_requests(prompts, len(self.workers)))
        idle = set(self.workers)
        generating: dict[Any, tuple[int, _Shard]] = {}
        training: tuple[Any, int] | None = None  # (ref, worker)
        stop_sent = False
        tally = self._tally  # includes the chunk settled at the start of this call
        self._tally = _Tally()
        spot_ok = True  # off for the rest of the call if a training chunk raised
        last_trainer: int | None = None

        def dispatch() -> None:
            while waiting and idle:
                index = min(idle)
                idle.discard(index)
                shard = waiting.popleft()
                shard.attempts += 1
                ref = self.workers[index].generate.remote(
                    shard.indices, [prompts[i] for i in shard.indices], [per_request[i] for i in shard.indices]
                )
                generating[ref] = (index, shard)
                self._event("shard", index, requests=len(shard.indices), attempt=shard.attempts)

        def can_train() -> bool:
            c = self.config
            return (
                self.drafter_state is not None
                and c.spot_training
                and spot_ok
                and tally.steps < c.max_spot_steps
                and bool(self.samples)
                and bool(generating)  # someone is still in the tail
                and not waiting
            )

        dispatch()
        while generating or waiting:  # waiting: a re-run shard whose only free worker is still training
            dispatch()
            if training is None and idle and can_train():
                index = last_trainer if last_trainer in idle else min(idle)  # it holds the optimizer
                idle.discard(index)
                last_trainer = index
                upto = self._sent_upto.get(index, -1)
                new = [s for i, s in self.samples if i > upto]  # each sample goes to a worker once
                self._sent_upto[index] = self._next_sample_id - 1
                holds = self._trainer_holds.get(index) == self.drafter_state.version
                steps = min(self.config.spot_steps_per_call, self.config.max_spot_steps - tally.steps)
                ref = self.workers[index].train_drafter.remote(
                    None if holds else self.drafter_state, new, steps, self.config.sample_buffer_mb << 20
                )
                training, stop_sent = (ref, index), False
                busy = sorted(i for i, _ in generating.values())
                self._event("spot_start", index, version=self.drafter_state.version, busy=busy)
            if training is not None and not stop_sent and waiting:
                self.workers[training[1]].stop_training.remote()  # work arrived for it
                stop_sent = True
                self._event("spot_stop", training[1], rollout_over=False)
            refs = list(generating) + ([training[0]] if training is not None else [])
            (ready,), _ = ray.wait(refs, num_returns=1)
            if training is not None and ready == training[0]:
                index = training[1]
                training = None
                outcome = self._settle_training(ready, index, tally)
                if outcome == "failed":
                    spot_ok = False
                if outcome != "lost":
                    idle.add(index)
                dispatch()
                continue
            index, shard = generating.pop(ready)
            try:
                res: GenerateResult = ray.get(ready)
            except ray.exceptions.RayActorError as e:
                self._mark_dead(index, e)
                tally.died += 1
                if shard.attempts >= self.config.max_shard_attempts:
                    raise RuntimeError(
                        f"a shard of {len(shard.indices)} requests failed on {shard.attempts} workers"
                    ) from e
                if not self.workers:
                    if not self.config.respawn_dead_workers:
                        raise RuntimeError("every rollout worker died") from e
                    idle.add(self._spawn())
                waiting.append(shard)
                self._event("rerun", index, requests=len(shard.indices))
                logger.warning("re-running %d requests of dead worker %d", len(shard.indices), index)
                dispatch()
                continue
            for i, out in zip(res.indices, res.outputs):
                outputs[i] = out
            for k in STAT_KEYS:
                stats[k] += res.stats[k]
            for k, v in res.strategy_steps.items():
                strategy_steps[k] = strategy_steps.get(k, 0) + v
            if res.samples:
                self._add_samples(res.samples)
            idle.add(index)
            self._event(
                "shard_done",
                index,
                requests=len(res.indices),
                samples=len(res.samples),
                drafter_version=res.drafter_version,
            )
            dispatch()
        self._event("rollout_end")
        if training is not None:  # it yields before its next step; settled (and counted) by the next call
            if not stop_sent:
                self.workers[training[1]].stop_training.remote()
                self._event("spot_stop", training[1], rollout_over=True)
            self._pending_training = training
        self._needs_broadcast = self.drafter_state is not None
        assert all(o is not None for o in outputs)
        return RolloutReport(
            outputs=outputs,  # type: ignore[arg-type]
            stats=stats,
            strategy_steps=strategy_steps,
            seconds=time.perf_counter() - start,
            spot_steps=tally.steps,
            spot_losses=tally.losses,
            drafter_version=self.drafter_state.version if self.drafter_state is not None else None,
            policy_version=self.policy_version,
            workers_died=tally.died,
        )

    def settle(self) -> None:
        """Finish what a rollout left running: collect the training chunk that was told to stop
        when the rollout ended (it yields before its next step), then send the newest drafter
        state to every worker. Called before the next rollout, policy sync or version query, so
        the tail of one RL step's drafter training overlaps the trainer's optimizer step."""
        if self._pending_training is not None:
            ref, index = self._pending_training
            self._pending_training = None
            self._settle_training(ref, index, self._tally)
        if self._needs_broadcast:
            self._needs_broadcast = False
            self._broadcast_drafter()

    def _settle_training(self, ref: Any, index: int, tally: _Tally) -> str:
        """Take a training chunk's result: ``done`` (state updated), ``lost`` (the worker died;
        training resumes from the last state) or ``failed`` (it raised)."""
        import ray

        try:
            result: TrainResult = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._mark_dead(index, e)
            tally.died += 1
            logger.warning(
                "drafter training on worker %d was lost with it; training resumes from version %d",
                index,
                self.drafter_state.version,
            )
            return "lost"
        except ray.exceptions.RayTaskError as e:
            logger.error("drafter training failed on worker %d (no more this rollout): %s", index, e)
            self._trainer_holds.pop(index, None)  # its trainer may have moved past our last state
            self._event("spot_failed", index, error=str(e)[:200])
            return "failed"
        self.drafter_state = result.state
        self._trainer_holds = {index: result.state.version}  # only this worker's trainer is current
        tally.steps += len(result.losses)
        tally.losses += result.losses
        self._event("spot_done", index, version=result.state.version, steps=len(result.losses))
        return "done"

    def publish_drafter(self, head: Eagle3Head) -> None:
        """Make ``head`` (trained outside the workers, e.g. by ``DrafterFromTrainer`` in the
        trainer process) the drafter every worker uses from the next rollout on. Spot training, if
        on, continues from it; the workers' optimizer states belong to the replaced version."""
        if self.head is None:
            raise ValueError("this coordinator drafts with no EAGLE-3 head; there is nothing to replace")
        self.settle()  # a training chunk that finished meanwhile must not overwrite the new state
        self.drafter_state = DrafterState.of(head)
        self._trainer_holds = {}
        self._needs_broadcast = True
        self._event("drafter_published", version=self.drafter_state.version)

    def _broadcast_drafter(self) -> None:
        """Every worker drafts with the newest version from the next rollout on; the driver's head
        object follows too (for checkpoints and export)."""
        import ray

        if self.drafter_state is None:
            return
        state_ref = ray.put(self.drafter_state)
        pending = {self.workers[i].set_drafter.remote(state_ref): i for i in list(self.workers)}
        for ref, index in pending.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._mark_dead(index, e)
        self.drafter_state.load_into(self.head)
        self._event("drafter_broadcast", version=self.drafter_state.version)
