"""``SpecRollout``: a TRL ``rollout_func`` backed by the tailspec engine.

TRL 1.16 calls ``rollout_func(prompts, trainer)`` with the per-process prompts *already repeated
num_generations times* and expects one completion per row, in order, as ``prompt_ids``,
``completion_ids`` and ``logprobs``. Identical prompts are prefilled once and forked by the
engine. In the colocated default the engine drives the trainer's live policy module (no weight
copy); the KV cache is kept between calls.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..drafter.catch_up import CatchUp
from ..drafter.factory import DrafterFor
from ..drafter.online_training import DrafterState, online_training, trained_part
from ..rollout.engine import RolloutEngine, eos_ids_of
from ..rollout.model.model_support import check_model
from ..rollout.params import SamplingParams
from ..rollout.position_noise import derived_seed
from ..rollout.stats import EngineCounts, acceptance_rate
from ..rollout.strategy import parse_strategy
from ..workers.coordinator import RolloutCoordinator, RolloutReport
from .config import SpecRolloutConfig
from .drafter_health import FIT_TO_CHECK, DrafterHealth
from .sampling_from_trl import sampling_params_from_trl

logger = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    num_prompts: int
    completion_tokens: int
    time_s: float
    tokens_per_s: float
    mean_completion_length: float
    max_completion_length: int
    preemptions: int
    strategy: str = "none"
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    mean_accept_length: float = 1.0  # tokens per sequence per speculative step
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    tail_time_s: float = 0.0  # decode time with <= tail_fraction of the call's peak still active
    strategy_steps: dict[str, int] = field(default_factory=dict)  # decode steps per strategy (adaptive mix)
    drafter_loss: float | None = None  # EAGLE-3 online training after this rollout
    drafter_version: int | None = None
    drafter_train_s: float = 0.0
    spot_train_steps: int = 0  # with Ray workers: drafter steps run on idle workers during the rollout
    spot_shipped: int = 0  # training chunks whose head became the drafting one (beat it on held-out samples)
    spot_held: int = 0  # chunks kept back: no better than the drafting head on held-out samples
    policy_version: int | None = None  # with Ray workers: the weights the workers generated with
    workers_died: int = 0
    idle_worker_s: float = 0.0  # with Ray workers: worker-seconds idle while another still generated
    spot_busy_s: float = 0.0  # of the rollout's worker-seconds, those a spot training chunk ran in
    drafter_lr_scale: float = 1.0  # catch-up: the drafter's learning-rate scale after this rollout
    completions_digest: str = ""  # a hash of the call's completions, in request order (same digest: same rollout)
    completion_digests: tuple[str, ...] = ()  # each completion's hash, in request order
    completion_lengths: tuple[int, ...] = ()  # each completion's tokens, in request order
    capture_time_s: float = 0.0  # of the call's time, what graph pools spent capturing (in-process and workers)
    calibration_time_s: float = 0.0  # of the call's time (summed over workers), adaptive's forward table timed
    drafter_health: float | None = None  # DrafterHealth's score (None without a model drafter)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted_tokens, self.drafted_tokens)


def completions_digest(completion_ids: list[list[int]]) -> str:
    """A short hash of the completions in order: two calls with equal digests emitted the same tokens."""
    h = hashlib.blake2b(digest_size=8)
    for ids in completion_ids:
        h.update(",".join(map(str, ids)).encode() + b";")
    return h.hexdigest()


def global_step(trainer: Any) -> int:
    """The trainer's global step (0 before training starts, or for a trainer without a state)."""
    return int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)


@dataclass
class _Rollout:
    """What a rollout gave, wherever it ran: outputs in prompt order, the engines' counters, the
    strategy it ran, and the workers' report (None in-process)."""

    outputs: list
    counts: EngineCounts
    strategy: str
    report: RolloutReport | None = None


class SpecRollout:
    """Callable meeting TRL's ``rollout_func(prompts, trainer) -> dict`` contract.

    ``model``/``tokenizer`` default to the trainer's policy and processing class; pass them to
    generate with a separate copy instead. ``drafter`` (a smaller causal LM sharing the
    tokenizer, or a :class:`tailspec.drafter.Drafter`) serves the ``chain``/``tree`` strategies.
    ``sampling`` overrides the parameters otherwise read from the trainer's ``GRPOConfig``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        tokenizer: Any | None = None,
        config: SpecRolloutConfig | None = None,
        sampling: SamplingParams | None = None,
        drafter: Any | None = None,
        drafter_training: Any | None = None,
        **config_overrides: Any,
    ) -> None:
        self.config = (config or SpecRolloutConfig()).with_overrides(**config_overrides)
        strategy = self.config.engine.strategy
        if drafter is None and parse_strategy(strategy).uses_model_drafter:
            raise ValueError(f"strategy {strategy!r} needs a drafter model; pass SpecRollout(drafter=...)")
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.drafter = drafter
        self.health = DrafterHealth()
        training = self.config.training
        # the drafter part trained here after every call (None: nothing trains in this process)
        self.online = online_training(
            drafter,
            training.drafter_train_steps,
            training.drafter_buffer_mb << 20,
            training.self_adapter_rank,
            drafter_training,
            holdout_every=training.holdout_every,
            ship_min_gain=training.ship_min_gain,
        )
        self.drafter_training = drafter_training
        self._engine: RolloutEngine | None = None
        self._engine_model_id: int | None = None
        self._plain: tuple[int, RolloutEngine] | None = None  # (policy id, engine) while the drafter does not fit
        self._coordinator: RolloutCoordinator | None = None
        self.policy_syncs = 0  # times new policy weights went to the Ray workers
        self._strategies_seen: set[str] = set()
        self.last_stats: RolloutStats | None = None
        self.history: list[RolloutStats] = []
        self._pending_state: dict[str, Any] | None = None  # loaded from a checkpoint, applied at start
        self.catch_up = CatchUp(self.config.training.catch_up)
        self._calls_at_step = (-1, 0)  # (global step, rollout calls made at it - 1): position-noise seeds

    # -- TRL entry point -------------------------------------------------------------------
    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        """One rollout, whatever runs it (this process's engine or the Ray workers): time it,
        record it, adjust the drafter's catch-up, train the drafter on it, return TRL's dict."""
        tokenizer = self.tokenizer or trainer.processing_class
        prompt_ids = self.tokenize_prompts(prompts, tokenizer, trainer)
        params = self._request_params(self.sampling or sampling_params_from_trl(trainer.args), len(prompt_ids), trainer)
        start = time.perf_counter()
        if self.config.workers.num_workers:
            rollout = self._on_workers(prompt_ids, params, tokenizer, trainer)
        else:
            rollout = self._in_process(prompt_ids, params, tokenizer, trainer)
        elapsed = time.perf_counter() - start
        completion_ids = [o.completion_ids for o in rollout.outputs]
        self._record(completion_ids, elapsed, rollout.counts, rollout.strategy, trainer)
        if rollout.report is not None:
            self._record_spot_training(rollout.report, trainer)
        self._catch_up()
        # in-process, the drafter learns here (on workers, in their idle time); a drafter that sat
        # this rollout out (a misfit) has nothing of it to train on
        in_process = rollout.report is None and self.online is not None and not self.health.misfit
        if in_process and self.config.training.drafter_train_steps:
            self.online.observe(prompt_ids, completion_ids)
            self._train_drafter(trainer)
        return self._trl_outputs(rollout.outputs)

    def _in_process(self, prompt_ids: list[list[int]], params, tokenizer: Any, trainer: Any) -> _Rollout:
        """The rollout on this process's engine, on the trainer's live module."""
        with self._policy(trainer) as model:
            if self._fits(model, tokenizer):
                engine = self.engine_for(model, tokenizer, seed=self._seed(trainer))
            else:  # lossless without the drafter; DrafterHealth warns and scores the rollout 0
                engine = self._plain_engine(model, tokenizer, seed=self._seed(trainer))
            engine.weights_changed()  # an optimizer step since the last rollout may have bumped no version counter
            before = engine.stats.counts()
            outputs = engine.generate(prompt_ids, params, progress=self.config.engine.progress)
        return _Rollout(outputs, engine.stats.counts() - before, str(engine.strategy))

    def _on_workers(self, prompt_ids: list[list[int]], params, tokenizer: Any, trainer: Any) -> _Rollout:
        """The rollout on Ray workers; the policy goes to them once per global step."""
        step = global_step(trainer)
        with self._policy(trainer) as model:
            self._require_fit(model, tokenizer)
            if self._coordinator is None:
                check_model(model)  # here, before any worker starts: a refusal is one line, not a failed shard
                self._coordinator = RolloutCoordinator(
                    model,
                    self.config.engine_config(self._seed(trainer)),
                    sorted(self._eos_ids(model, tokenizer)),
                    drafter=self.drafter,
                    config=self.config.workers,
                    training=self.drafter_training,
                    policy_version=step,
                )
                if self._pending_state is not None:
                    self._coordinator.load_state_dict(self._pending_state)
                    self._pending_state = None
            else:
                self.policy_syncs += self._coordinator.sync_policy(model, step)
        report = self._coordinator.generate(prompt_ids, params)
        return _Rollout(report.outputs, report.counts, self.config.engine.strategy, report)

    def _request_params(self, params: SamplingParams, n: int, trainer: Any) -> SamplingParams | list[SamplingParams]:
        """``params`` for every request, or with ``position_noise`` one copy per request with its
        own derived seed (the call's place in the run: the trainer's global step, then the calls
        made at that step)."""
        if not self.config.position_noise:
            return params
        step = global_step(trainer)
        call = self._calls_at_step[1] + 1 if self._calls_at_step[0] == step else 0
        self._calls_at_step = (step, call)
        base = self._seed(trainer) if params.seed is None else params.seed
        return [params.with_updates(noise="position", seed=derived_seed(base, step, call, i)) for i in range(n)]

    @staticmethod
    def _trl_outputs(outputs: list) -> dict[str, list]:
        return {
            "prompt_ids": [o.prompt_ids for o in outputs],
            "completion_ids": [o.completion_ids for o in outputs],
            "logprobs": [o.logprobs for o in outputs],
        }

    def sync_weights(self, trainer: Any) -> None:
        """New policy weights (once per global step, called by ``tailspec.GRPOTrainer``): sent to
        the Ray workers; nothing to do for the colocated engine, which runs on the live module."""
        if self._coordinator is None:
            return
        step = global_step(trainer)
        with self._policy(trainer) as model:
            self._require_fit(model, self.tokenizer or getattr(trainer, "processing_class", None))
            self.policy_syncs += self._coordinator.sync_policy(model, step)

    def _fits(self, model: torch.nn.Module, tokenizer: Any) -> bool:
        """Whether the drafter fits ``model`` as it is at this sync (see ``drafter.factory.fit_problems``);
        what does not fit goes to ``health``."""
        from ..drafter.factory import fit_problems

        self.health.fit(fit_problems(self.drafter, model, tokenizer))
        return not self.health.misfit

    def _require_fit(self, model: torch.nn.Module, tokenizer: Any) -> None:
        """On Ray workers a policy the drafter does not fit cannot be synced at all (their engines
        and drafters were built for the policy's shape): a clear error before the sync."""
        if not self._fits(model, tokenizer):
            raise ValueError(
                f"the drafter does not fit the policy to sync to the Ray workers: {'; '.join(self.health.misfit)}; "
                f"{FIT_TO_CHECK}"
            )

    def _plain_engine(self, model: torch.nn.Module, tokenizer: Any, seed: int) -> RolloutEngine:
        """An engine without the drafter for a rollout whose policy the drafter does not fit (kept
        while the policy object is the same)."""
        if self._plain is None or self._plain[0] != id(model):
            cfg = replace(self.config.engine_config(seed), strategy="none")
            engine = RolloutEngine(model, cfg, eos_token_ids=self._eos_ids(model, tokenizer), tokenizer=tokenizer)
            self._plain = (id(model), engine)
        return self._plain[1]

    def publish_drafter(self, head: Any) -> bool:
        """``head`` was trained outside this rollout (``DrafterFromTrainer``): Ray workers draft
        with it from the next rollout on. True when that applies: this rollout drafts with that
        very head object and runs workers (the colocated engine reads the object itself)."""
        if head is not self.drafter or self._coordinator is None:
            return False
        self._coordinator.publish_drafter(head)
        return True

    @property
    def coordinator(self) -> RolloutCoordinator | None:
        return self._coordinator

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What this rollout learned, for a checkpoint (``tailspec.GRPOTrainer`` saves it with every
        trainer checkpoint; see :mod:`tailspec.trainer_hooks.rollout_state`): the drafter state
        (an EAGLE-3 head's weights, optimizer, step, version), each engine's selector measurements
        and suffix history, the workers' length predictor and the catch-up rule's reference. Before
        the first rollout: what was loaded, if anything."""
        if self._coordinator is not None:
            return {**self._coordinator.state_dict(), "catch_up": self.catch_up.state_dict()}
        if self._engine is None and self._pending_state is not None:
            return self._pending_state
        drafter = self._drafter_state()
        engines = [self._engine.state_dict()] if self._engine is not None else []
        return {"engines": engines, "predictor": None, "drafter": drafter, "catch_up": self.catch_up.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`. The head's weights and version load at once (into the
        ``drafter`` object); the rest when the engine or the workers start, or now if they run."""
        drafter = state.get("drafter")
        if drafter is not None:
            if self.online is not None:
                self.online.load(drafter)  # weights now (once made), the optimizer with its trainer
            elif (part := trained_part(self.drafter)) is not None:
                drafter.load_into(part)
            else:
                raise ValueError(
                    "the saved rollout state has a drafter state (an EAGLE-3 head, streaming heads or an exit "
                    "adapter); this rollout drafts with none of them"
                )
        self.catch_up.load_state_dict(state.get("catch_up"))
        self._pending_state = state
        if self._coordinator is not None:
            self._coordinator.load_state_dict(state)
            self._pending_state = None
        elif self._engine is not None:
            self._apply_pending(self._engine)

    def _drafter_state(self) -> DrafterState | None:
        """What online training changes (or, untrained here, what a checkpoint still keeps)."""
        if self.online is not None:
            return self.online.state()
        part = trained_part(self.drafter)
        return DrafterState.of(part) if part is not None else None

    def _apply_pending(self, engine: RolloutEngine) -> None:
        state, self._pending_state = self._pending_state, None
        if state is None:
            return
        if state.get("engines"):
            engine.load_state_dict(state["engines"][0])

    def close(self, *, wait: bool = True) -> None:
        """Stop the Ray workers (if any). ``wait=False``, on an interrupt, kills them at once and
        stops the local Ray instance the rollout started; ``tailspec.GRPOTrainer`` does this
        when training is interrupted. The next call starts new workers."""
        if self._coordinator is not None:
            coordinator, self._coordinator = self._coordinator, None
            coordinator.shutdown(wait=wait, stop_ray=not wait)

    def __enter__(self) -> SpecRollout:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        self.close(wait=kind is None)

    # -- pieces ----------------------------------------------------------------------------
    @staticmethod
    def tokenize_prompts(prompts: list, tokenizer: Any, trainer: Any | None = None) -> list[list[int]]:
        """Token ids of each prompt, exactly as TRL's own generation path would build them."""
        if not prompts:
            raise ValueError("prompts is empty")
        if getattr(trainer, "tools", None):
            raise ValueError("SpecRollout does not run tool calls; construct the trainer without tools")
        conversational = isinstance(prompts[0], list)
        if conversational:
            for p in prompts:
                for message in p:
                    if not isinstance(message.get("content"), str):
                        raise ValueError("SpecRollout supports text-only conversations (content must be a str)")
            kwargs = dict(getattr(trainer, "chat_template_kwargs", None) or {})
            encoded = tokenizer.apply_chat_template(
                conversation=prompts,
                chat_template=getattr(trainer, "chat_template", None),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **kwargs,
            )
            return [list(ids) for ids in encoded["input_ids"]]
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must all be strings or all be conversations (lists of messages)")
        return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]

    def engine_for(self, model: torch.nn.Module, tokenizer: Any, seed: int) -> RolloutEngine:
        """The engine for ``model``, rebuilt only when the model object changes."""
        if self._engine is None or self._engine_model_id != id(model):
            eos = self._eos_ids(model, tokenizer)
            cfg = self.config.engine_config(seed)
            drafter = self.drafter
            if self.online is not None:  # bound to what the engine decodes on: the model or its copy (dtype)
                online = self.online
                drafter = DrafterFor(lambda policy: online.engine_drafter(policy, cfg))
            self._engine = RolloutEngine(model, cfg, eos_token_ids=eos, tokenizer=tokenizer, drafter=drafter)
            self._engine_model_id = id(model)
            self._apply_pending(self._engine)
        return self._engine

    @staticmethod
    def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
        eos = set(eos_ids_of(model))
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        return eos

    def _catch_up(self) -> None:
        """The last rollout's accept length into the catch-up rule; the drafter's training (here,
        on the workers, and DrafterFromTrainer's, which reads ``drafter_lr_scale``) follows it."""
        stats = self.last_stats
        scale = self.catch_up.observe(stats.mean_accept_length, stats.drafted_tokens)
        stats.drafter_lr_scale = scale
        if self._coordinator is not None:
            self._coordinator.set_drafter_lr_scale(scale)

    @property
    def drafter_lr_scale(self) -> float:
        """The learning-rate scale drafter training should use now (catch-up; 1.0 normally)."""
        return self.catch_up.lr_scale

    def _train_drafter(self, trainer: Any) -> None:
        """Online training after a rollout (``drafter/online_training.py``), at the catch-up rate."""
        start = time.perf_counter()
        losses = self.online.train(self.config.training.drafter_train_steps, self.catch_up.lr_scale)
        stats = self.last_stats
        stats.drafter_train_s = time.perf_counter() - start
        stats.drafter_version = int(self.online.part.version)
        if losses:
            stats.drafter_loss = sum(losses) / len(losses)
        metrics = getattr(trainer, "_metrics", None)
        if self.config.log_metrics and metrics is not None and stats.drafter_loss is not None:
            mode = "train" if getattr(trainer.model, "training", True) else "eval"
            metrics[mode]["drafter/loss"].append(stats.drafter_loss)
            metrics[mode]["drafter/version"].append(float(stats.drafter_version))
            metrics[mode]["drafter/train_s"].append(stats.drafter_train_s)

    def _record_spot_training(self, report: RolloutReport, trainer: Any) -> None:
        stats = self.last_stats
        stats.spot_train_steps = report.spot_steps
        stats.spot_shipped, stats.spot_held = report.spot_shipped, report.spot_held
        stats.drafter_version = report.drafter_version
        stats.policy_version = report.policy_version
        stats.workers_died = report.workers_died
        stats.idle_worker_s, stats.spot_busy_s = report.idle_worker_s, report.spot_busy_s
        if report.spot_losses:
            stats.drafter_loss = sum(report.spot_losses) / len(report.spot_losses)
        metrics = getattr(trainer, "_metrics", None)
        if self.config.log_metrics and metrics is not None and report.drafter_version is not None:
            mode = "train" if getattr(trainer.model, "training", True) else "eval"
            metrics[mode]["drafter/spot_steps"].append(float(report.spot_steps))
            metrics[mode]["drafter/spot_shipped"].append(float(report.spot_shipped))
            metrics[mode]["drafter/version"].append(float(report.drafter_version))
            if report.spot_held_out:
                drafting, trained = report.spot_held_out[-1]
                metrics[mode]["drafter/held_out_gain"].append(trained - drafting)
            if stats.drafter_loss is not None:
                metrics[mode]["drafter/loss"].append(stats.drafter_loss)

    @property
    def engine(self) -> RolloutEngine | None:
        return self._engine

    def _seed(self, trainer: Any) -> int:
        if self.config.seed is not None:
            return self.config.seed
        args = getattr(trainer, "args", None)
        rank = getattr(getattr(trainer, "accelerator", None), "process_index", 0)
        return int(getattr(args, "seed", 0)) + int(rank)

    @contextmanager
    def _policy(self, trainer: Any) -> Iterator[torch.nn.Module]:
        """The module to generate with: ours, or the trainer's live policy (unwrapped, and
        gathered under ZeRO-3 as TRL's own generation does)."""
        if self.model is not None:
            with nullcontext(self.model) as model:
                yield model
            return
        from trl.models import unwrap_model_for_generation

        args = trainer.args
        with unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=getattr(args, "ds3_gather_for_generation", True),
            gradient_checkpointing_kwargs=getattr(args, "gradient_checkpointing_kwargs", None),
        ) as model:
            yield model

    def _record(
        self,
        completion_ids: list[list[int]],
        elapsed: float,
        counts: EngineCounts,
        strategy: str,
        trainer: Any,
    ) -> None:
        """Stats of one rollout call from what the engine counted meanwhile (one engine, or summed
        over workers), into ``last_stats``/``history`` and the trainer's metrics."""
        lengths = [len(c) for c in completion_ids]
        total = sum(lengths)
        stats = RolloutStats(
            num_prompts=len(lengths),
            completion_tokens=total,
            time_s=elapsed,
            tokens_per_s=total / elapsed if elapsed > 0 else 0.0,
            mean_completion_length=total / max(1, len(lengths)),
            max_completion_length=max(lengths, default=0),
            preemptions=counts.preemptions,
            strategy=strategy,
            drafted_tokens=counts.drafted_tokens,
            accepted_tokens=counts.accepted_tokens,
            mean_accept_length=counts.mean_accept_length,
            draft_time_s=counts.draft_time_s,
            verify_time_s=counts.verify_time_s,
            tail_time_s=counts.tail_time_s,
            strategy_steps=dict(counts.strategy_steps),
            completions_digest=completions_digest(completion_ids),
            completion_digests=tuple(completions_digest([ids]) for ids in completion_ids),
            completion_lengths=tuple(lengths),
            capture_time_s=counts.capture_time_s,
            calibration_time_s=counts.calibration_time_s,
        )
        if self.drafter is not None:
            model_steps = sum(n for k, n in counts.strategy_steps.items() if parse_strategy(k).uses_model_drafter)
            adaptive = parse_strategy(self.config.engine.strategy).adaptive
            stats.drafter_health = self.health.update(stats.mean_accept_length, model_steps, adaptive)
        self.last_stats = stats
        self.history.append(stats)
        logger.info(
            "rollout: %d completions, %d tokens in %.2fs (%.0f tok/s; %.2fs capturing graphs, %.2fs calibrating), "
            "strategy %s, accept length %.2f",
            stats.num_prompts,
            total,
            elapsed,
            stats.tokens_per_s,
            stats.capture_time_s,
            stats.calibration_time_s,
            stats.strategy,
            stats.mean_accept_length,
        )
        self._log_metrics(stats, trainer)

    def _log_metrics(self, stats: RolloutStats, trainer: Any) -> None:
        """One rollout's numbers into the trainer's metrics (TRL logs them, to wandb too)."""
        metrics = getattr(trainer, "_metrics", None)
        if not self.config.log_metrics or metrics is None:
            return
        logged = metrics["train" if getattr(trainer.model, "training", True) else "eval"]
        logged["rollout/time_s"].append(stats.time_s)
        logged["rollout/tokens_per_s"].append(stats.tokens_per_s)
        logged["rollout/tail_s"].append(stats.tail_time_s)
        if stats.calibration_time_s:
            logged["rollout/calibration_s"].append(stats.calibration_time_s)
        steps = sum(stats.strategy_steps.values())
        if steps:
            spec = sum(v for k, v in stats.strategy_steps.items() if k != "none")
            logged["rollout/speculative_step_fraction"].append(spec / steps)
            # the strategy mix: every strategy seen so far gets a value each call (0 when unused)
            self._strategies_seen.update(stats.strategy_steps)
            for name in sorted(self._strategies_seen):
                logged[f"rollout/strategy_fraction/{name}"].append(stats.strategy_steps.get(name, 0) / steps)
        if stats.drafter_health is not None:
            logged["rollout/drafter_health"].append(stats.drafter_health)
        if stats.drafted_tokens:
            logged["rollout/accept_length"].append(stats.mean_accept_length)
            logged["rollout/acceptance_rate"].append(stats.acceptance_rate)
