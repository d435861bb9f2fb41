"""The rollout engine: continuous batching over a paged KV cache, driving a Hugging Face model.

Use :meth:`RolloutEngine.generate` for a batch of prompts (one completion per prompt, in
order), or the step-wise API (:meth:`add_request`, :meth:`step`) to interleave submission and
generation. Bad requests are refused with ``ValueError`` before they touch any running batch.

A step reads schedule -> prefill or decode. Every decode step has one shape, propose -> forward ->
verify -> commit (:class:`DecodeStep`); which strategy it runs is planned and measured from outside
it (:class:`StepMeter`); where its drafts come from is the :class:`Proposer`'s; the front ends that
loop over steps are in ``serving.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager

import torch

from ..draft_contract import Drafter, Stateful, drafter_factory
from . import serving
from .adaptive.calibration import calibrate_costs
from .adaptive.choice import StrategyChoice
from .adaptive.forward_table import ForwardTable
from .adaptive.meter import StepMeter
from .adaptive.selector import SelectorConfig, StrategySelector
from .admission import RequestLimits, eos_ids_of, prepare_requests
from .decode_step import DecodeStep
from .feature_taps import FeatureTaps
from .handoff import PartialRequest, RequestInbox, ServeUpdate
from .model.graph_pool import graph_pool_for
from .model.host_memory import keep_freed_host_memory
from .model.runner import ModelRunner
from .params import RolloutConfig, SamplingParams
from .prefill import commit_prefill, pack_prefill
from .proposer import Proposer
from .request import RequestOutput, SeqStatus, Sequence
from .request_book import RequestBook
from .sampling import store_prompt_logprobs
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
        self.config = config or RolloutConfig()
        self.runner = ModelRunner(
            model,
            self.config.total_blocks,
            self.config.block_size,
            graph_pool=graph_pool_for(model, self.config),
            cache_prefixes=self.config.prefix_caching,
            compile_layers=self.config.compile,
            merge_projections=self.config.merge_projections,
            dtype=self.config.dtype,
        )
        self.model = model = self.runner.model  # what it decodes on: the model, or its copy in config.dtype
        keep_freed_host_memory(self.runner.device.type)  # CPU forwards: freed buffers kept for reuse
        self.vocab_size = self.runner.vocab_size
        self.limits = RequestLimits.of(model, self.config)
        self.max_model_len = self.limits.max_model_len
        self.eos_ids = frozenset(eos_token_ids) if eos_token_ids is not None else eos_ids_of(model, tokenizer)
        bad_eos = [i for i in self.eos_ids if not 0 <= i < self.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids {bad_eos} are outside the vocabulary [0, {self.vocab_size})")
        self.scheduler = Scheduler(
            self.runner.cache.allocator,
            self.config.block_size,
            self.config.max_num_seqs,
            self.config.max_prefill_tokens,
        )
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.stats = EngineStats()
        drafters = drafter_factory()(drafter, model, self.config, self.vocab_size, tokenizer)
        if self.config.prefix_caching and drafters.model is not None:
            raise ValueError(
                "prefix_caching does not work with a model drafter yet (the drafter would miss the cached "
                "prefix); use prefix_caching=False or a model-free strategy (suffix)"
            )
        self.proposer = Proposer(model, drafters, self.config)
        self.drafter, self.suffix_drafter = drafters.model, drafters.suffix
        self.choice = StrategyChoice(self.config, self.drafter, self._calibrate, self.stats)
        self.meter = StepMeter(self.choice, self.stats, self.config.tail_fraction, tokens_to_go)
        self.requests = RequestBook(self.scheduler, self.limits, self.eos_ids, self.proposer)
        layers = self.drafter.feature_layers if self.drafter is not None else None
        self.taps = FeatureTaps(self.runner, layers, self.proposer.observe)  # what an EAGLE-style drafter reads
        self.decode = DecodeStep(
            self.runner,
            self.config,
            self.proposer,
            self.taps,
            self.generator,
            self.stats,
            self.requests.finish,
            self.limits.max_model_len,
        )
        self._settled_early: list[int] = []  # requests that finished when a step in flight was read outside a step
        self.set_strategy(self.config.strategy)

    # -- speculation set-up --------------------------------------------------------------
    def set_strategy(self, strategy: str | Strategy) -> None:
        """Switch the speculation strategy; takes effect at the next decode step (an overlapped step
        in flight is read now: a switch to ``adaptive`` may calibrate before it plans)."""
        self._read_in_flight()
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

    @property
    def mirror(self):
        """The mirror pipeline, once a mirror step (or a strategy with mirror arms) started it."""
        return self.proposer.mirror

    @property
    def mirror_capable(self) -> bool:
        """Its steps can run mirror steps with a drafter a peer's draft host can take over."""
        return self.proposer.hostable(self.choice.arms, bool(self.taps.layers))

    def use_draft_executor(self, executor) -> None:
        """Mirror steps draft on ``executor`` (a ``workers.draft_hosts.PeerExecutor``: another worker's
        draft host, a ``rollout.mirror.executors.DraftExecutor``) from the next step on; None: on the
        engine's own executor again. Safe to call from another thread: the switch happens between steps."""
        self.proposer.use_executor(executor)

    def weights_changed(self) -> None:
        """Tell the engine its model's weights changed (``ModelRunner.weights_changed``): needed
        after an optimizer step that bumps no version counter (torch's fused AdamW); other in-place
        changes and moved weights it notices itself."""
        self.runner.weights_changed()

    def close(self) -> None:
        """Stop the mirror draft executor's thread or process, if one was started."""
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
        return self.scheduler.has_work() or self.decode.in_flight is not None

    def abort(self, request_id: int) -> None:
        # the step in flight is read first: the request keeps every token sampled for it, and the
        # blocks it frees hold K/V of tokens it knows (prefix caching registers them by their tokens)
        self._read_in_flight()
        self.requests.abort(request_id)

    def discard(self, request_id: int) -> None:
        """Abort a request and drop it, finished or not (a front end's caller stopped early)."""
        self._read_in_flight()
        self.requests.discard(request_id)

    def release(self, request_id: int) -> PartialRequest:
        """Stop an unfinished request and hand over its state, to be continued elsewhere."""
        self._read_in_flight()  # a token in flight is part of what is handed over
        return self.requests.release(request_id)

    def pop_output(self, request_id: int) -> RequestOutput:
        """A finished request's output (an unfinished one raises ``ValueError`` and stays)."""
        return self.requests.pop_output(request_id)

    def step(self) -> list[int]:
        """Run one scheduled forward; return the ids of requests that finished in it (overlapped:
        in the step before it, read now)."""
        overlap = self._overlaps()
        finished, self._settled_early = self._settled_early, []
        if not overlap:
            finished += self.decode.settle()
        if self.proposer.switch_pending:  # alive() walks every request: only when an executor waits
            self.proposer.between_steps(self.requests.alive(), self.mirror_capable)
        if not self.scheduler.running:
            self.meter.before_rollout(len(self.scheduler.waiting))
        if self.config.prefix_caching and self.scheduler.waiting:  # only admission reads the cache
            self.runner.drop_stale_prefixes()
        mixed = self.config.mixed_batches and not self.strategy.speculative and not self.strategy.adaptive
        batch = self.scheduler.schedule(mixed=mixed)
        if batch is None:
            return finished + self.decode.settle()  # every sequence left has its final token in flight
        with self.inference():
            if batch.kind is StepKind.DECODE:
                finished += self._decode_step(batch.seqs, overlap)
            else:  # PREFILL, or MIXED: a running sequence is a prompt with one uncached token
                finished += self._prefill(batch)
                self.stats.mixed_steps += batch.kind is StepKind.MIXED
        if not self.scheduler.running:
            finished += self.decode.settle()  # rows of finished sequences alone: nothing is left in flight
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens
        return finished

    def _overlaps(self) -> bool:
        """Whether this step may be launched before the step in flight is read (``config.overlap``):
        a decode step that admits no prompt and preempts nothing, plain (``rollout/sampled.py``) or
        a fixed chain's or tree's on the device (``rollout/spec/device_step.py``, where each batch
        is checked again); under ``adaptive``, a step it plans plain (one it plans speculative reads the step
        in flight first, :meth:`_decode_step`). A drafter reading the target's features gets a dropped row's
        too, past its sequence's last token: what it records is cut to the tokens at the finish."""
        scheduler = self.scheduler
        steady = not self.proposer.switch_pending
        steady &= not self.strategy.speculative or self.decode.on_device.serves(self.strategy)
        return self.config.overlap and steady and not scheduler.waiting and scheduler.decode_fits()

    def _read_in_flight(self) -> None:
        """Read an overlapped step in flight outside a step; its finished requests are the next step's."""
        self._settled_early += self.decode.settle()

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

    # -- internals -----------------------------------------------------------------------
    def _prefill(self, batch: ScheduledBatch) -> list[int]:
        pack = pack_prefill(batch)
        logits = self.decode.forward(pack.slices, pack.tokens, pack.positions, pack.logits_index)
        if pack.scored:
            store_prompt_logprobs(pack.scored, logits[len(pack.last) :], batch.followers)
            logits = logits[: len(pack.last)]
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += len(pack.tokens)
        seqs, rows, observed = commit_prefill(batch, pack, self._fork_from)
        self.taps.observe(observed, logits)
        self.stats.forked_prefills += len(seqs) - len(batch.seqs)
        return self.decode.append(self.decode.sample(seqs, logits[rows] if len(rows) != len(batch.seqs) else logits))

    def _fork_from(self, leader: Sequence, member: Sequence) -> None:
        """Member shares the leader's full blocks; copy the leader's partial last block."""
        bs = self.config.block_size
        partial = leader.num_tokens % bs
        if partial:
            self.runner.cache.copy_block(leader.block_table[-1], member.block_table[-1], partial)
        member.num_cached = leader.num_cached

    def _decode_step(self, seqs: list[Sequence], overlap: bool) -> list[int]:
        """One decode step of the strategy the meter plans, timed by it."""
        plan, finished = self.meter.plan(seqs), []
        on_device = self.decode.on_device.serves(plan.strategy)  # a step launched from the device's state
        if plan.strategy.speculative and not on_device and self.decode.in_flight is not None:
            # adaptive planned a host-read speculative step after overlapped ones: it is timed whole,
            # so the step in flight is read first, outside every step's timer (each overlapped step's
            # timer ends with its read of the one before)
            finished = self.decode.settle()
            if len(running := [s for s in seqs if s.status is SeqStatus.RUNNING]) < len(seqs):
                if not running:  # every one stopped on the token just read
                    return finished
                seqs, plan = running, self.meter.plan(running)
        overlap &= not plan.strategy.speculative or on_device  # ... and leaves none in flight
        # the first step of an overlapped run reads nothing: its timer holds a launch, not a step
        unread = overlap and not plan.strategy.speculative and self.decode.in_flight is None
        return finished + self.meter.run(plan, seqs, unread, lambda: self.decode(seqs, plan.strategy, overlap))
