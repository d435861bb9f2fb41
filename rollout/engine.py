"""The rollout engine: continuous batching over a paged KV cache, driving a Hugging Face model.

Use :meth:`RolloutEngine.generate` for a batch of prompts (one completion per prompt, in
order), or the step-wise API (:meth:`add_request`, :meth:`step`) to interleave submission and
generation. Bad requests are refused with ``ValueError`` before they touch any running batch.

One loop runs every step: ``in_flight = step(schedule(), in_flight)``. Each iteration launches a
step (:class:`StepLauncher`: prefill, plain, or speculative from any drafter) and then commits the
one before it, the only place tokens reach the host (``launched.py``). Which strategy a decode step
runs is planned and measured from outside it (:class:`StepMeter`); where its drafts come from is the
:class:`Proposer`'s; the front ends that loop over steps are in ``serving.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager

import torch

from ..draft_contract import Drafter, DrafterSet, Stateful, drafter_factory
from . import serving
from .adaptive.calibration import calibrate_costs
from .adaptive.choice import StrategyChoice
from .adaptive.forward_table import ForwardTable
from .adaptive.meter import StepMeter
from .adaptive.selector import SelectorConfig, StrategySelector
from .admission import RequestLimits, eos_ids_of, prepare_requests
from .feature_taps import FeatureTaps
from .handoff import PartialRequest, RequestInbox, ServeUpdate
from .launched import Launched
from .launcher import StepLauncher
from .model.graph_pool import graph_pool_for
from .model.host_memory import keep_freed_host_memory
from .model.recurrent_state import refuse_what_state_cannot_serve
from .model.runner import ModelRunner
from .params import RolloutConfig, SamplingParams
from .proposer import Proposer
from .request import RequestOutput
from .request_book import RequestBook
from .scheduler import ScheduledBatch, Scheduler, StepKind
from .spec.length_budget import tokens_to_go
from .stats import EngineStats, StepRecord
from .strategy import Strategy

__all__ = ["EngineStats", "RequestLimits", "RolloutEngine", "StepRecord", "eos_ids_of", "prepare_requests"]

logger = logging.getLogger(__name__)


class RolloutEngine:
    """Continuous-batching generator over a paged KV cache, with optional speculative decoding.

    ``drafter`` (a :class:`tailspec.drafter.Drafter`, an EAGLE-3 head for this model, or a smaller
    Hugging Face causal LM that shares the tokenizer) serves the ``chain``/``tree`` strategies;
    the model-free suffix drafter is built in. The strategy comes from ``config.strategy`` and can
    change between steps (:meth:`set_strategy`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: RolloutConfig | None = None,
        *,
        eos_token_ids: Iterable[int] | None = None,
        tokenizer=None,
        drafter: Drafter | torch.nn.Module | None = None,
    ) -> None:
        self.config = config = config or RolloutConfig()
        self.runner = ModelRunner(
            model,
            config.total_blocks,
            config.block_size,
            graph_pool=graph_pool_for(model, config),
            cache_prefixes=config.prefix_caching,
            compile_layers=config.compile,
            merge_projections=config.merge_projections,
            dtype=config.dtype,
            state_slots=config.max_num_seqs + 1,  # a recurrent model's state: a slot per running sequence
        )
        self.model = model = self.runner.model  # what it decodes on: the model, or its copy in config.dtype
        keep_freed_host_memory(self.runner.device.type)  # CPU forwards: freed buffers kept for reuse
        self.vocab_size = self.runner.vocab_size
        self.limits = RequestLimits.of(model, config)
        self.max_model_len = self.limits.max_model_len
        self.eos_ids = frozenset(eos_token_ids) if eos_token_ids is not None else eos_ids_of(model, tokenizer)
        if bad_eos := [i for i in self.eos_ids if not 0 <= i < self.vocab_size]:
            raise ValueError(f"eos_token_ids {bad_eos} are outside the vocabulary [0, {self.vocab_size})")
        self.scheduler = Scheduler(
            self.runner.cache.allocator,
            config.block_size,
            config.max_num_seqs,
            config.max_prefill_tokens,
            self.runner.states,
        )
        refuse_what_state_cannot_serve(self.runner.states, config.prefix_caching)
        self.stats = EngineStats()
        self._speculate_with(drafter_factory()(drafter, model, config, self.vocab_size, tokenizer))
        self.in_flight: Launched | None = None  # the step launched last and not yet retired by the loop
        self.set_strategy(config.strategy)

    def _speculate_with(self, drafters: DrafterSet) -> None:
        """The drafters, the strategy choice and its meter, and the launcher of every step."""
        config = self.config
        if config.prefix_caching and drafters.model is not None:
            raise ValueError(
                "prefix_caching does not work with a model drafter yet (the drafter would miss the cached "
                "prefix); use prefix_caching=False or a model-free strategy (suffix)"
            )
        self.drafters, self.proposer = drafters, Proposer(drafters, config)
        self.drafter, self.suffix_drafter = drafters.model, drafters.suffix
        self.choice = StrategyChoice(config, self.drafter, self._calibrate, self.stats)
        self.meter = StepMeter(self.choice, self.stats, config.tail_fraction, tokens_to_go, self.runner.device)
        self.requests = RequestBook(self.scheduler, self.limits, self.eos_ids, self.proposer)
        layers = self.drafter.feature_layers if self.drafter is not None else None
        self.taps = FeatureTaps(self.runner, layers, self.proposer.observe)  # what an EAGLE-style drafter reads
        self.launcher = StepLauncher(self.runner, config, self.proposer, self.taps, self.stats, self.requests)

    # -- speculation set-up --------------------------------------------------------------
    def set_strategy(self, strategy: str | Strategy) -> None:
        """Switch the speculation strategy; takes effect at the next decode step (launched from the
        step in flight's state where it can be, whatever that step's strategy was)."""
        self.choice.set(strategy)
        self.proposer.prepare(self.choice.arms)

    def expect_batch(self, batch: int) -> None:
        """The next rollouts reach about ``batch`` sequences at once though they start with fewer
        (requests arriving while it runs, as on a Ray worker): ``adaptive`` calibrates that batch
        before the first of them rather than extrapolating to it."""
        self.choice.expect(batch)

    @property
    def strategy(self) -> Strategy:
        return self.choice.strategy

    @property
    def selector(self) -> StrategySelector | None:
        """The adaptive strategy's selector (made with the first ``adaptive`` strategy)."""
        return self.choice.selector

    def weights_changed(self) -> None:
        """Tell the engine its model's weights changed (``ModelRunner.weights_changed``): needed
        after an optimizer step that bumps no version counter (torch's fused AdamW); other in-place
        changes and moved weights it notices itself. The step in flight, launched with the weights
        before, is committed first."""
        self.sync()
        self.runner.weights_changed()

    def close(self) -> None:
        """Stop the draft executor's thread or process of its mirror steps, if one was started."""
        self.proposer.close()

    def state_dict(self) -> dict:
        """What the engine learned across calls (JSON-serializable): the adaptive selector's
        measurements and the suffix drafter's remembered completions. Model and drafter weights
        are saved by their owners."""
        suffix = self.suffix_drafter.state_dict() if isinstance(self.suffix_drafter, Stateful) else None
        return {"selector": self.choice.state_dict(), "suffix": suffix}

    def load_state_dict(self, state: dict) -> None:
        self.choice.load_state_dict(state.get("selector"))
        if state.get("suffix") is not None and isinstance(self.suffix_drafter, Stateful):
            self.suffix_drafter.load_state_dict(state["suffix"])

    def _calibrate(
        self, config: SelectorConfig, arms: Seq[Strategy], max_batch: int, known: ForwardTable | None, fresh: bool
    ) -> ForwardTable:
        """The adaptive selector's forward table, timed on this engine's model (``rollout/adaptive/calibration.py``)."""
        cfg, taps = self.config, tuple(self.taps.layers or ())
        return calibrate_costs(
            self.runner, config, arms, cfg.block_size, max_batch, cfg.kernels, known, fresh, self.taps.forward, taps
        )

    # -- step-wise API (rollout/request_book.py) ----------------------------------------
    def add_request(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams | None = None,
        *,
        group: int | None = None,
        resume: PartialRequest | None = None,
        expected_length: float | None = None,
    ) -> int:
        """Queue a request; ``resume`` continues one released by another engine (:meth:`release`);
        ``expected_length`` (a predicted completion length) steers the length-aware draft budget
        (``RolloutConfig.length_budget``), never the output; ``group`` marks a prompt group."""
        params = params or SamplingParams()
        seq = self.requests.new_sequence(prompt_ids, params, group=None if resume else group)
        seq.expected_length = expected_length
        if resume is not None:
            if list(resume.prompt_ids) != seq.prompt_ids or resume.params != params:
                raise ValueError("resume: the partial request belongs to another prompt or other sampling params")
            seq.resume_from(resume)
        return self.requests.admit(seq)

    def new_group(self) -> int:
        return self.requests.new_group()

    def has_unfinished(self) -> bool:
        """Requests wait or run, or the step in flight holds tokens or finished requests that
        :meth:`step` has not reported yet."""
        in_flight = self.in_flight
        return self.scheduler.has_work() or (
            in_flight is not None and (not in_flight.committed or bool(in_flight.commit().finished))
        )

    def abort(self, request_id: int) -> None:
        # the step in flight is committed first: the request keeps every token sampled for it, and the
        # blocks it frees hold K/V of tokens it knows (prefix caching registers them by their tokens)
        self.sync()
        self.requests.abort(request_id)

    def discard(self, request_id: int) -> None:
        """Abort a request and drop it, finished or not (a front end's caller stopped early)."""
        self.sync()
        self.requests.discard(request_id)

    def release(self, request_id: int) -> PartialRequest | None:
        """Stop an unfinished request and hand over its state, to be continued elsewhere. The step
        in flight is committed first (its tokens are part of what is handed over); None where the
        request has finished, on them or before (its output waits for :meth:`pop_output`)."""
        self.sync()
        return None if self.requests.finished(request_id) else self.requests.release(request_id)

    def pop_output(self, request_id: int) -> RequestOutput:
        """A finished request's output (an unfinished one raises ``ValueError`` and stays)."""
        return self.requests.pop_output(request_id)

    def step(self) -> list[int]:
        """One iteration of the loop: launch the scheduled step, then commit the step before it;
        the ids of the requests that finished (in the step before, or earlier since the last call)."""
        if not self.scheduler.running:
            self.meter.before_rollout(len(self.scheduler.waiting))
        if self.config.prefix_caching and self.scheduler.waiting:  # only admission reads the cache
            self.runner.drop_stale_prefixes()
        previous = self.in_flight
        mixed = self.config.mixed_batches and not self.strategy.speculative and not self.strategy.adaptive
        batch = self.scheduler.schedule(mixed, previous)
        self.in_flight = self._launch(batch, previous) if batch is not None else None
        self.stats.overlapped_steps += self.in_flight is not None and previous is not None and not previous.committed
        finished = self.meter.retire(previous).finished if previous is not None else []
        if self.in_flight is not None and not self.scheduler.running:  # rows of finished sequences alone
            finished += self.meter.retire(self.in_flight).finished
            self.in_flight = None
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens
        return finished

    def _launch(self, batch: ScheduledBatch, previous: Launched | None) -> Launched | None:
        """Launch ``batch``: a prefill (or MIXED: a running sequence is a prompt with one uncached
        token), or a decode step of the strategy the meter plans, its clock started."""
        with self.inference():
            if batch.kind is not StepKind.DECODE:
                self.stats.mixed_steps += batch.kind is StepKind.MIXED
                return self.launcher.prefill(batch)
            plan, seqs = self.meter.plan(batch.seqs, previous), batch.seqs
            return self.meter.launch(plan, seqs, lambda: self.launcher.decode(seqs, plan.strategy, previous))

    def sync(self) -> None:
        """Commit the step in flight now: every token sampled is in its request's output (the
        requests it finished are still reported by the next :meth:`step`)."""
        if self.in_flight is not None:
            self.in_flight.commit()

    # -- front ends (rollout/serving.py) -------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params=None, *, progress: bool | None = None) -> list[RequestOutput]:
        """One completion per prompt, in order (:func:`serving.generate`)."""
        return serving.generate(self, prompts, params, progress=progress)

    def generate_stream(
        self, prompts: Seq[Seq[int]], params=None, *, progress: bool | None = None
    ) -> Iterator[list[tuple[int, RequestOutput]]]:
        """Each step's finished requests as ``(prompt index, output)`` (:func:`serving.generate_stream`)."""
        return serving.generate_stream(self, prompts, params, progress=progress)

    def serve(self, inbox: RequestInbox, *, idle_wait_s: float = 0.5) -> Iterator[ServeUpdate]:
        """Serve what arrives in ``inbox`` (:func:`serving.serve`)."""
        return serving.serve(self, inbox, idle_wait_s=idle_wait_s)

    def inference(self) -> AbstractContextManager[None]:
        """no_grad + eval mode + paged attention for the model (``ModelRunner.inference``), re-entrant."""
        return self.runner.inference(self.config.kernels)
