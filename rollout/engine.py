"""The rollout engine: continuous batching over a paged KV cache, driving a Hugging Face model.

Use :meth:`RolloutEngine.generate` for a batch of prompts (one completion per prompt, in
order), or the step-wise API (:meth:`add_request`, :meth:`step`) to interleave submission and
generation. Bad requests are refused with ``ValueError`` before they touch any running batch.

A step reads schedule -> forward -> sample or speculate -> commit. Which strategy a decode step
runs is :class:`StrategyChoice`'s (the configured one, or adaptive's pick); where a mirror step's
drafts come from is :class:`MirrorSlot`'s; the front ends that loop over steps are in
``serving.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager

import torch

from ..draft_contract import Drafter, Stateful, drafter_factory
from ..kernels.transfers import QueuedRead
from . import serving
from .adaptive.calibration import calibrate_costs
from .adaptive.choice import DrafterLag, StepOutcome, StepPlan, StrategyChoice
from .adaptive.cost_model import ForwardTable
from .adaptive.selector import SelectorConfig, StrategySelector
from .admission import RequestLimits, eos_ids_of, prepare_requests
from .decode_step import SpeculativeStep
from .feature_taps import FeatureTaps
from .handoff import PartialRequest, RequestInbox, ServeUpdate
from .mirror.executors import DraftExecutor
from .mirror.pipeline import MirrorPipeline
from .mirror.slot import MirrorSlot
from .model.attention import SequenceSlice
from .model.graph_pool import capture_seconds, graph_pool_for
from .model.runner import ModelRunner
from .params import RolloutConfig, SamplingParams
from .prefill import commit_prefill, pack_prefill
from .request import RequestOutput, SeqStatus, Sequence
from .request_book import RequestBook
from .sampled import Sampled
from .sampling import sample_tokens, store_prompt_logprobs
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
        self.drafter, self.suffix_drafter, self.hybrid_drafter = drafters.model, drafters.suffix, drafters.hybrid
        if self.config.prefix_caching and self.drafter is not None:
            raise ValueError(
                "prefix_caching does not work with a model drafter yet (the drafter would miss the cached "
                "prefix); use prefix_caching=False or a model-free strategy (suffix)"
            )
        self.choice = StrategyChoice(self.config, self.drafter, self._calibrate)
        self.lag = DrafterLag()
        self.mirrors = MirrorSlot(model, self.drafter, self.config.mirror, self.config.kernels)
        notified = [d for d in (self.drafter, self.suffix_drafter) if d is not None]  # of finished sequences
        self.requests = RequestBook(self.scheduler, self.limits, self.eos_ids, notified, self.mirrors)
        self.taps = FeatureTaps(self.runner, self.drafter, self.mirrors)  # what an EAGLE-style drafter reads
        self.speculate = SpeculativeStep(
            self.runner,
            self.config,
            self._drafter_for,
            self.mirrors,
            self.taps,
            self._forward,
            self.generator,
            self.stats,
        )
        self._peak_active = 0
        self.in_flight: Sampled | None = None  # an overlapped decode step not yet read (config.overlap)
        self._settled_early: list[int] = []  # requests that finished when it was read outside a step
        self.set_strategy(self.config.strategy)

    # -- speculation set-up --------------------------------------------------------------
    def set_strategy(self, strategy: str | Strategy) -> None:
        """Switch the speculation strategy; takes effect at the next decode step (an overlapped step
        in flight is read now: a switch to ``adaptive`` may calibrate before it plans)."""
        self._settled_early += self._settle()
        self.choice.set(strategy)
        self.mirrors.prepare(self.choice.arms)

    @property
    def strategy(self) -> Strategy:
        return self.choice.strategy

    @property
    def selector(self) -> StrategySelector | None:
        """The adaptive strategy's selector (made with the first ``adaptive`` strategy)."""
        return self.choice.selector

    @property
    def mirror(self) -> MirrorPipeline | None:
        """The mirror pipeline, once a mirror step (or a strategy with mirror arms) started it."""
        return self.mirrors.pipeline

    @property
    def mirror_capable(self) -> bool:
        """Its steps can run mirror steps with a drafter a peer's draft host can take over."""
        return self.mirrors.hostable(self.choice.arms, bool(self.taps.layers))

    def use_draft_executor(self, executor: DraftExecutor | None) -> None:
        """Mirror steps draft on ``executor`` (a ``workers.draft_hosts.PeerExecutor``: another worker's draft host)
        from the next step on; None: on the engine's own executor again. Safe to call from another
        thread: the switch happens between steps."""
        self.mirrors.use_executor(executor)

    def weights_changed(self) -> None:
        """Tell the engine its model's weights changed (``ModelRunner.weights_changed``): needed
        after an optimizer step that bumps no version counter (torch's fused AdamW); other in-place
        changes and moved weights it notices itself."""
        self.runner.weights_changed()

    def close(self) -> None:
        """Stop the mirror draft executor's thread or process, if one was started."""
        self.mirrors.close()

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

    def _drafter_for(self, strategy: Strategy) -> Drafter:
        if strategy.kind == "suffix":
            return self.suffix_drafter
        return self.hybrid_drafter if strategy.kind == "hybrid" else self.drafter

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
        return self.scheduler.has_work() or self.in_flight is not None

    def abort(self, request_id: int) -> None:
        # the step in flight is read first: the request keeps every token sampled for it, and the
        # blocks it frees hold K/V of tokens it knows (prefix caching registers them by their tokens)
        self._settled_early += self._settle()
        self.requests.abort(request_id)

    def discard(self, request_id: int) -> None:
        """Abort a request and drop it, finished or not (a front end's caller stopped early)."""
        self._settled_early += self._settle()
        self.requests.discard(request_id)

    def release(self, request_id: int) -> PartialRequest:
        """Stop an unfinished request and hand over its state, to be continued elsewhere."""
        self._settled_early += self._settle()  # a token in flight is part of what is handed over
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
            finished += self._settle()
        if self.mirrors.switch_pending:
            self.mirrors.switch_between_steps(self.requests.alive(), self.mirror_capable)
        if not self.scheduler.running:
            self.choice.before_rollout(len(self.scheduler.waiting))
            self.lag.clear()
        if self.config.prefix_caching and self.scheduler.waiting:  # only admission reads the cache
            self.runner.drop_stale_prefixes()
        mixed = self.config.mixed_batches and not self.strategy.speculative and not self.strategy.adaptive
        batch = self.scheduler.schedule(mixed=mixed)
        if batch is None:
            return finished + self._settle()  # every sequence left has its final token in flight
        with self.inference():
            if batch.kind is StepKind.DECODE:
                finished += self._decode_step(batch, overlap)
            else:  # PREFILL, or MIXED: a running sequence is a prompt with one uncached token
                finished += self._prefill(batch)
                self.stats.mixed_steps += batch.kind is StepKind.MIXED
        if not self.scheduler.running:
            finished += self._settle()  # rows of finished sequences alone: nothing is left in flight
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens
        return finished

    def _overlaps(self) -> bool:
        """Whether this step may be launched before the step in flight is read (``config.overlap``):
        a plain decode step that admits no prompt and preempts nothing (``rollout/sampled.py``);
        under ``adaptive``, a step it plans plain (one it plans speculative reads the step in flight
        first, :meth:`_decode_step`). A drafter reading the target's features gets a dropped row's
        too, past its sequence's last token: what it records is cut to the tokens at the finish."""
        scheduler = self.scheduler
        plain = not (self.strategy.speculative or self.mirrors.switch_pending)
        return self.config.overlap and plain and not scheduler.waiting and scheduler.decode_fits()

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
        logits = self._forward(pack.slices, pack.tokens, pack.positions, pack.logits_index)
        if pack.scored:
            store_prompt_logprobs(pack.scored, logits[len(pack.last) :], batch.followers)
            logits = logits[: len(pack.last)]
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += len(pack.tokens)
        seqs, rows, observed = commit_prefill(batch, pack, self._fork_from)
        self.taps.observe(observed, logits)
        self.stats.forked_prefills += len(seqs) - len(batch.seqs)
        return self._append(self._sample(seqs, logits[rows] if len(rows) != len(batch.seqs) else logits))

    def _fork_from(self, leader: Sequence, member: Sequence) -> None:
        """Member shares the leader's full blocks; copy the leader's partial last block."""
        bs = self.config.block_size
        partial = leader.num_tokens % bs
        if partial:
            self.runner.cache.copy_block(leader.block_table[-1], member.block_table[-1], partial)
        member.num_cached = leader.num_cached

    def _decode_step(self, batch: ScheduledBatch, overlap: bool) -> list[int]:
        """One decode step with the strategy :class:`StrategyChoice` plans; timed and logged.

        The step's own read of the sampled tokens already waits for the device, so the goodput
        measurement adds no synchronisation of its own (overlapped: a step's timer holds its launch
        and the read of the step before it, which waits out that step's device work)."""
        seqs, stats = batch.seqs, self.stats
        plan = self._plan(seqs)
        finished: list[int] = []
        if plan.strategy.speculative and self.in_flight is not None:
            # adaptive planned a speculative step after overlapped plain ones: drafting and
            # verification read every token on the host, so the step in flight is read first,
            # outside every step's timer (each overlapped step's timer ends with its read of the one before)
            finished = self._settle()
            if len(running := [s for s in seqs if s.status is SeqStatus.RUNNING]) < len(seqs):
                seqs = running  # some stopped on the token just read
                if not seqs:
                    return finished
                plan = self._plan(seqs)
        # the first step of an overlapped run reads nothing: its timer holds a launch, not a step
        unread = overlap and not plan.strategy.speculative and self.in_flight is None
        n, adaptive = len(seqs), self.strategy.adaptive
        meets_prompts = adaptive and plan.strategy.uses_model_drafter and self.lag.meets_new(seqs)
        self.mirrors.split_threads(plan.strategy)
        before, model_before, draft_before = stats.generated_tokens, stats.model_time_s, stats.draft_time_s
        captured_before = capture_seconds()
        start = time.perf_counter()
        verified = None
        if plan.strategy.speculative:
            verified = self.speculate(seqs, plan.strategy)
            finished += self._finish(verified.done)
        else:
            finished += self._decode(seqs, overlap)
        seconds = time.perf_counter() - start
        stats.decode_model_time_s += stats.model_time_s - model_before
        emitted = stats.generated_tokens - before
        if adaptive and plan.strategy.uses_model_drafter:
            self.lag.drafted(seqs)
        # an arm is judged by its steady steps: one that captured a graph (the target's or the
        # drafter's), fed the model drafter a prompt or read no step before it teaches acceptance only
        captured = capture_seconds() - captured_before
        stats.capture_time_s += captured
        one_off = meets_prompts or captured > 0 or unread
        draft_s = stats.draft_time_s - draft_before
        outcome = StepOutcome(seconds, draft_s, one_off)
        if verified is not None:
            outcome = StepOutcome(seconds, draft_s, one_off, verified.drafted, verified.accepted, verified.branches)
        self.choice.record(plan, n, outcome)
        self._peak_active = max(self._peak_active, n)
        in_tail = n <= self.config.tail_fraction * self._peak_active
        stats.record_decode_step(StepRecord(n, str(plan.strategy), emitted, seconds, in_tail))
        if not self.scheduler.has_work():
            self._peak_active = 0  # the wave is over; the next one measures its own peak
        return finished

    def _plan(self, seqs: list[Sequence]) -> StepPlan:
        """The step's strategy; only ``adaptive`` weighs the remaining work and a drafter's catch-up."""
        n = len(seqs)
        return self.choice.plan(n, *((tokens_to_go(seqs), self.lag.of(seqs)) if self.strategy.adaptive else (n, 0)))

    def _decode(self, seqs: list[Sequence], overlap: bool) -> list[int]:
        """One token for each sequence. Overlapped, this step is launched, then the step in flight
        is read, and this one stays in flight; its inputs are the step in flight's tokens."""
        in_flight = self.in_flight
        tokens = in_flight.inputs_for(seqs) if in_flight is not None else [s.token_at(s.num_cached) for s in seqs]
        slices = [SequenceSlice(seq.block_table, seq.num_cached, 1) for seq in seqs]
        positions = [seq.num_cached for seq in seqs]
        logits = self._forward(slices, tokens, positions, list(range(len(seqs))))
        self.taps.observe([(seq, seq.num_cached, [row], [row]) for row, seq in enumerate(seqs)], logits)
        for seq in seqs:
            seq.num_cached += 1
        self.stats.decode_steps += 1
        self.stats.batch_sizes.append(len(seqs))
        launched = self._sample(seqs, logits)
        finished = self._settle()
        if overlap:
            self.in_flight = launched
            self.stats.overlapped_steps += 1
            return finished
        return finished + self._append(launched)

    def _forward(self, slices, tokens, positions, logits_index) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.taps.forward(slices, tokens, positions, logits_index)
        self.stats.model_time_s += time.perf_counter() - start
        return logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> Sampled:
        """Each sequence's next token, sampled on the device; its read to the host queued."""
        tokens, logprobs = sample_tokens(seqs, logits, self.generator, [seq.tokens_in_flight for seq in seqs])
        for seq in seqs:
            seq.tokens_in_flight += 1
        return Sampled(seqs, tokens, QueuedRead(tokens, logprobs))

    def _settle(self) -> list[int]:
        """Read the step in flight, if one is: its tokens appended, its finished requests finished."""
        launched, self.in_flight = self.in_flight, None
        return self._append(launched) if launched is not None else []

    def _append(self, sampled: Sampled) -> list[int]:
        """Append the sampled tokens (waiting for them); the ids of the requests they finished. A
        row of a request that finished, was aborted or handed over meanwhile is dropped."""
        tokens, logprobs = sampled.read()
        finished = []
        for seq, token, logprob in zip(sampled.seqs, tokens, logprobs):
            seq.tokens_in_flight -= 1
            if seq.status is SeqStatus.FINISHED:
                self.stats.dropped_rows += 1
                continue
            seq.append(token, logprob)
            self.stats.generated_tokens += 1
            if seq.done:
                self.requests.finish(seq)
                finished.append(seq.seq_id)
        return finished

    def _finish(self, done: list[Sequence]) -> list[int]:
        for seq in done:
            self.requests.finish(seq)
        return [seq.seq_id for seq in done]
