"""The rollout engine: continuous batching over a paged KV cache, driving a Hugging Face model.

Use :meth:`RolloutEngine.generate` for a batch of prompts (one completion per prompt, in
order), or the step-wise API (:meth:`add_request`, :meth:`step`) to interleave submission and
generation. Bad requests are refused with ``ValueError`` before they touch any running batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager, nullcontext

import torch

from ..draft_contract import Drafter, DraftTree, Portable, Stateful, Versioned, drafter_factory
from ..kernels.dispatch import kernel_backend
from ..progress import progress_bar
from .admission import RequestLimits, eos_ids_of, prepare_requests
from .attention import SequenceSlice, paged_attention_enabled
from .draft_executor import DraftExecutor, ExecutorError
from .graph_pool import capture_seconds, graph_pool_for
from .handoff import InboxItem, PartialRequest, RequestInbox, ServeUpdate
from .length_budget import drafting_mask, spread_mask
from .mirror import MirrorPipeline
from .model_runner import ModelRunner
from .params import MirrorConfig, RolloutConfig, SamplingParams
from .position_noise import keyed_scores
from .request import FinishReason, RequestOutput, SeqStatus, Sequence
from .sampling import BatchSamplingTensors, choose_tokens, draw_uniforms, processed_logprobs, store_prompt_logprobs
from .scheduler import ScheduledBatch, Scheduler, StepKind
from .spec_step import accept, commit, propose, verify
from .speculative import pack_verify_batch, release_unused_blocks
from .stats import EngineStats, StepRecord
from .strategy import Strategy, parse_strategy
from .token_ids import token_id_list

__all__ = ["EngineStats", "RequestLimits", "RolloutEngine", "StepRecord", "eos_ids_of", "prepare_requests"]

logger = logging.getLogger(__name__)
SWITCH_GAP = 4  # a model-drafter step after this many steps without the drafter is a switch (its catch-up)


class RolloutEngine:
    """Continuous-batching generator over a paged KV cache, with optional speculative decoding.

    ``drafter`` (a :class:`tailspec.drafter.Drafter`, an EAGLE-3 head for this model, or a smaller
    Hugging Face causal LM that shares the tokenizer) serves the ``chain``/``tree`` strategies;
    the model-free suffix drafter is built in. The strategy comes from ``config.strategy`` and can change between steps
    (:meth:`set_strategy`).
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
        self.model = model
        self.config = config or RolloutConfig()
        self.runner = ModelRunner(
            model,
            self.config.total_blocks,
            self.config.block_size,
            graph_pool=graph_pool_for(model, self.config),
            cache_prefixes=self.config.prefix_caching,
        )
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
        self._next_id = 0
        self._next_group = 0
        self._seqs: dict[int, Sequence] = {}
        self._in_inference = False
        drafters = drafter_factory()(drafter, model, self.config, self.vocab_size, tokenizer)
        self.drafter, self.suffix_drafter, self.hybrid_drafter = drafters.model, drafters.suffix, drafters.hybrid
        self._versioned = isinstance(self.drafter, Versioned)  # its version is read every adaptive step
        if self.config.prefix_caching and self.drafter is not None:
            raise ValueError(
                "prefix_caching does not work with a model drafter yet (the drafter would miss the cached "
                "prefix); use prefix_caching=False or a model-free strategy (suffix)"
            )
        self._weights_fingerprint: int | None = None
        # an EAGLE-style drafter reads target features: tap them in every forward (whatever the
        # strategy), so switching to it never needs a re-prefill
        self.feature_layers = self.drafter.feature_layers if self.drafter is not None else None
        self._features: torch.Tensor | None = None  # the last forward's taps, [T, feature_size]
        self.selector = None  # made when the strategy is "adaptive"; kept across calls (learned state)
        self.mirror: MirrorPipeline | None = None  # made on the first mirror step (starts its executor)
        self._next_executor: list | None = None  # [executor or None] for the mirror from the next step
        self._mirror_config = self.config.mirror or MirrorConfig()
        self._peak_active = 0
        self._model_drafter_gap = SWITCH_GAP  # decode steps since the model drafter last drafted
        self._full_draft_gap = SWITCH_GAP  # ... since it last drafted for every sequence (not a probe)
        self.strategy = Strategy("none")
        self.set_strategy(self.config.strategy)

    # -- speculation set-up --------------------------------------------------------------
    def set_strategy(self, strategy: str | Strategy) -> None:
        """Switch the speculation strategy; takes effect at the next decode step."""
        parsed = parse_strategy(strategy)
        if parsed.uses_model_drafter and self.drafter is None:
            raise ValueError(
                f"strategy {str(parsed)!r} needs a drafter model; pass drafter=... to the engine "
                "(or use 'none' or 'suffix')"
            )
        if parsed.adaptive:
            self._ensure_selector()
        if parsed.mirror or (parsed.adaptive and any(a.mirror for a in self.selector.arms)):
            self._check_mirror()
            self._ensure_mirror()  # start the executor now, not inside a measured step
        self.strategy = parsed

    def _check_mirror(self) -> None:
        """Refuse a mirror strategy this engine cannot run, before any step does."""
        from .early_exit import check_exit_layer

        check_exit_layer(self.model, self._mirror_config.exit_layer or self._num_layers // 2)

    @property
    def _num_layers(self) -> int:
        from .model_runner import decoder_layers

        return len(decoder_layers(self.model))

    def _ensure_mirror(self) -> MirrorPipeline:
        if self.mirror is None:
            from .draft_executor import make_executor
            from .model_runner import model_device_dtype

            cfg = self._mirror_config
            portable = isinstance(self.drafter, Portable)
            draft_device = next(self.drafter.shipped_weights().parameters()).device if portable else None
            executor = make_executor(
                cfg.executor,
                self.drafter,
                self.drafter.rebuild if portable else None,
                model_device_dtype(self.model)[0],
                draft_device,
                cfg.draft_threads,
            )
            self.mirror = MirrorPipeline(self.model, executor, cfg.exit_layer or self._num_layers // 2, self.drafter)
        return self.mirror

    @property
    def mirror_capable(self) -> bool:
        """Its strategy can run mirror steps (a mirror strategy, or ``adaptive`` with mirror arms)
        with a drafter that a peer's draft host can take over mid-rollout: one that can be rebuilt
        elsewhere and catches up from tokens alone (not the EAGLE-3 head: a host that starts late
        has none of the target's features for what was decoded before)."""
        s = self.strategy
        arms = self.selector.arms if s.adaptive and self.selector is not None else []
        mirrored = s.mirror or any(a.mirror for a in arms)
        return mirrored and isinstance(self.drafter, Portable) and not self.feature_layers

    def use_draft_executor(self, executor: DraftExecutor | None) -> None:
        """Mirror steps draft on ``executor`` (a :class:`PeerExecutor`: another worker's draft host)
        from the next step on; None: on the engine's own executor again. Safe to call from another
        thread: the switch happens between steps."""
        self._next_executor = [executor]

    def _switch_executor(self) -> None:
        pending, self._next_executor = self._next_executor, None
        if pending is None or not self.mirror_capable:
            if pending is not None and pending[0] is not None:
                pending[0].close()
            return
        alive = [s.seq_id for s in self._seqs.values() if s.status is not SeqStatus.FINISHED]
        self._ensure_mirror().use_executor(pending[0], alive)

    def close(self) -> None:
        """Stop the mirror draft executor's thread or process, if one was started."""
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None

    def _ensure_selector(self):
        if self.selector is None:
            from .selector import StrategySelector

            self.selector = StrategySelector(self.config.selector, has_model_drafter=self.drafter is not None)
            if self.drafter is None and self.selector.dropped_arms:
                logger.warning(
                    "strategy 'adaptive' has no model drafter, so it chooses among %s only and drops %s: "
                    "pass drafter= (a smaller LM, an EAGLE-3 head or 'self:L') for the drafting arms that pay most",
                    [str(a) for a in self.selector.arms],
                    [str(a) for a in self.selector.dropped_arms],
                )
        return self.selector

    def state_dict(self) -> dict:
        """What the engine learned across calls (JSON-serializable): the adaptive selector's
        measurements and the suffix drafter's remembered completions. Model and drafter weights
        are saved by their owners."""
        return {
            "selector": self.selector.state_dict() if self.selector is not None else None,
            "suffix": self.suffix_drafter.state_dict() if isinstance(self.suffix_drafter, Stateful) else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("selector") is not None:
            self._ensure_selector().load_state_dict(state["selector"])
        if state.get("suffix") is not None and isinstance(self.suffix_drafter, Stateful):
            self.suffix_drafter.load_state_dict(state["suffix"])

    def _drafter_for(self, strategy: Strategy) -> Drafter:
        if strategy.kind == "suffix":
            return self.suffix_drafter
        return self.hybrid_drafter if strategy.kind == "hybrid" else self.drafter

    # -- validation ----------------------------------------------------------------------
    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request cannot be served."""
        self.limits.check(prompt_ids, params)

    # -- step-wise API -------------------------------------------------------------------
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
        (``RolloutConfig.length_budget``), never the output."""
        params = params or SamplingParams()
        prompt_ids = token_id_list(prompt_ids)
        self.validate(prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seq = Sequence(self._next_id, list(prompt_ids), params, stop_ids, group=None if resume else group)
        seq.expected_length = expected_length
        if resume is not None:
            if list(resume.prompt_ids) != seq.prompt_ids or resume.params != params:
                raise ValueError("resume: the partial request belongs to another prompt or other sampling params")
            seq.resume_from(resume)
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def new_group(self) -> int:
        self._next_group += 1
        return self._next_group

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, request_id: int) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and seq.status is not SeqStatus.FINISHED:
            self.scheduler.abort(seq)
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
            self._forget(seq)

    def release(self, request_id: int) -> PartialRequest:
        """Stop an unfinished request and hand over its state, to be continued elsewhere."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            raise ValueError(f"request {request_id} is not running here")
        partial = seq.to_partial()
        self.scheduler.abort(seq)
        self._forget(seq)
        del self._seqs[request_id]
        return partial

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        for drafter in (self.drafter, self.suffix_drafter):
            if drafter is not None:
                drafter.finished(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        for drafter in (self.drafter, self.suffix_drafter):
            if drafter is not None:
                drafter.release(seq.seq_id)
        if self.mirror is not None:
            self.mirror.release(seq.seq_id)
            if self.mirror.drafter is not self.drafter and not self.mirror.failed:
                self.mirror.drafter.release(seq.seq_id)

    def pop_output(self, request_id: int) -> RequestOutput:
        seq = self._seqs[request_id]
        if seq.status is not SeqStatus.FINISHED:
            raise ValueError(f"request {request_id} has not finished")  # and stays retrievable
        del self._seqs[request_id]
        return seq.to_output()

    def step(self) -> list[int]:
        """Run one scheduled forward; return the ids of requests that finished in it."""
        if self._next_executor is not None:
            self._switch_executor()
        if self.config.prefix_caching and self.scheduler.waiting:  # only admission reads the cache
            self._drop_stale_prefixes()
        mixed = self.config.mixed_batches and not self.strategy.speculative and not self.strategy.adaptive
        batch = self.scheduler.schedule(mixed=mixed)
        if batch is None:
            return []
        with self._inference():
            if batch.kind is StepKind.DECODE:
                finished = self._decode_step(batch)
            else:  # PREFILL, or MIXED: a running sequence is a prompt with one uncached token
                finished = self._prefill(batch)
                if batch.kind is StepKind.MIXED:
                    self.stats.mixed_steps += 1
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens
        return finished

    # -- batch API -----------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """One completion per prompt, in order. Identical prompts are prefilled once and forked.

        Every request is validated before any is submitted: one bad request raises
        ``ValueError`` (naming its index) and nothing of the call runs.
        """
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for finished in self.generate_stream(prompts, params, progress=progress):
            for index, output in finished:
                outputs[index] = output
        return outputs  # type: ignore[return-value]

    def generate_stream(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        progress: bool | None = None,
    ) -> Iterator[list[tuple[int, RequestOutput]]]:
        """:meth:`generate` that hands over each step's finished requests as ``(prompt index,
        output)`` pairs the moment they finish (a Ray worker streams them on, so a worker that
        dies loses only what had not finished). Requests are validated and submitted by this call;
        those left when the caller stops iterating are aborted."""
        prompts, per_request = prepare_requests(prompts, params, self.limits)
        index_of: dict[int, int] = {}  # request id -> prompt index
        self._admit([InboxItem(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, per_request))], index_of)
        return self._stream_finished(index_of, self.config.progress if progress is None else progress)

    def _stream_finished(self, index_of: dict[int, int], show: bool) -> Iterator[list[tuple[int, RequestOutput]]]:
        bar = progress_bar(total=len(index_of), desc="rollout", unit="seq", disable=not show, leave=False)
        start = time.perf_counter()
        try:
            while index_of:
                done: list[int] = []
                with self._inference():  # left while suspended: the caller may use the model meanwhile
                    while not done:
                        if not self.has_unfinished():
                            raise RuntimeError("engine idle with unfinished requests (scheduler bug)")
                        done = [r for r in self.step() if r in index_of]
                bar.update(len(done))
                yield [(index_of.pop(r), self.pop_output(r)) for r in done]
        finally:
            for request_id in index_of:
                self.abort(request_id)
                self._seqs.pop(request_id, None)
            bar.close()
            self.stats.wall_time_s += time.perf_counter() - start

    def serve(self, inbox: RequestInbox, *, idle_wait_s: float = 0.5) -> Iterator[ServeUpdate]:
        """Serve what arrives in ``inbox`` until it is closed and everything taken has finished or
        been given back: requests join the running batch at the next step (continuous batching
        across submissions); a step's finished and released requests are yielded together, under
        their inbox keys. Fresh requests taken together with the same prompt are prefilled once."""
        key_of: dict[int, int] = {}  # request id -> inbox key
        start = time.perf_counter()
        try:
            while True:
                take = inbox.take()
                update = ServeUpdate(released=[(item.key, item.resume) for item in take.released_waiting])
                self._admit(take.items, key_of)
                held = {key: rid for rid, key in key_of.items()}
                for key in take.release:
                    if key in held:
                        update.released.append((key, self.release(held[key])))
                        del key_of[held[key]]
                if key_of and not update.released:
                    with self._inference():
                        while not update.finished and not inbox.has_news():
                            update.finished = [(key_of.pop(r), self.pop_output(r)) for r in self.step() if r in key_of]
                if update:
                    yield update
                elif not key_of:
                    if take.may_end:
                        return
                    inbox.wait(idle_wait_s)
        finally:
            for request_id in key_of:
                self.abort(request_id)
                self._seqs.pop(request_id, None)
            self.stats.wall_time_s += time.perf_counter() - start

    def _admit(self, items: list[InboxItem], key_of: dict[int, int]) -> None:
        """Add ``items`` (recording request id -> item key); fresh requests of one prompt form a group."""
        counts: dict[tuple[int, ...], int] = {}
        for item in items:
            if item.resume is None:
                counts[tuple(item.prompt_ids)] = counts.get(tuple(item.prompt_ids), 0) + 1
        groups: dict[tuple[int, ...], int] = {}
        for item in items:
            key = tuple(item.prompt_ids)
            group = groups.setdefault(key, self.new_group()) if counts.get(key, 0) > 1 and item.resume is None else None
            rid = self.add_request(
                item.prompt_ids, item.params, group=group, resume=item.resume, expected_length=item.expected_length
            )
            key_of[rid] = item.key

    # -- internals -----------------------------------------------------------------------
    def _drop_stale_prefixes(self) -> None:
        """Cached K/V is only valid for the weights that computed it: forget it when any parameter
        was replaced or changed in place (optimizer steps and ``load_state_dict`` bump tensor
        version counters)."""
        fingerprint = hash(tuple((p.data_ptr(), p._version) for p in self.model.parameters()))
        if fingerprint != self._weights_fingerprint:
            if self._weights_fingerprint is not None:
                self.runner.cache.allocator.clear_prefixes()
            self._weights_fingerprint = fingerprint

    @contextmanager
    def _inference(self) -> Iterator[None]:
        """no_grad + eval mode + paged attention for the model, restored afterwards.

        Re-entrant: ``generate_stream`` enters it around its steps, so ``step`` pays nothing inside.
        """
        if self._in_inference:
            yield
            return
        was_training = self.model.training
        self.model.eval()
        self._in_inference = True
        try:
            with torch.no_grad(), paged_attention_enabled(self.model), kernel_backend(self.config.kernels):
                yield
        finally:
            self._in_inference = False
            self.model.train(was_training)

    def _prefill(self, batch: ScheduledBatch) -> list[int]:
        slices, tokens, positions, last = [], [], [], []
        scored: list[tuple[Sequence, int]] = []  # (leader, tokens scored for it and its followers)
        score_rows: list[int] = []
        for seq in batch.seqs:
            new = seq.uncached_tokens()
            slices.append(SequenceSlice(seq.block_table, seq.num_cached, len(new)))
            positions.extend(range(seq.num_cached, seq.num_tokens))
            tokens.extend(new)
            last.append(len(tokens) - 1)
            group = [seq, *batch.followers.get(seq.seq_id, [])]
            n = max((s.params.prompt_logprobs for s in group if s.prompt_logprobs is None), default=0)
            if n:
                # the logits at prompt position j predict token j + 1
                first = len(tokens) - len(new) + (len(seq.prompt_ids) - 1 - n - seq.num_cached)
                if first < len(tokens) - len(new):
                    raise RuntimeError("prompt logprobs requested for a prompt that is already cached")
                scored.append((seq, n))
                score_rows.extend(range(first, first + n))
        logits = self._forward(slices, tokens, positions, last + score_rows)
        if scored:
            store_prompt_logprobs(scored, logits[len(last) :], batch.followers)
            logits = logits[: len(last)]
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += len(tokens)

        rows, seqs = [], []
        observed: list[tuple[Sequence, int, list[int], list[int]]] = []
        for row, seq in enumerate(batch.seqs):
            start, end = last[row] + 1 - slices[row].num_new, last[row] + 1
            observed.append((seq, seq.num_cached, list(range(start, end)), [row]))
            seq.num_cached = seq.num_tokens
            rows.append(row)
            seqs.append(seq)
            for member in batch.followers.get(seq.seq_id, []):
                self._fork_from(seq, member)
                observed.append((member, 0, list(range(start, end)), [row]))
                rows.append(row)
                seqs.append(member)
        self._observe(observed, logits)
        self.stats.forked_prefills += len(seqs) - len(batch.seqs)
        return self._sample_and_append(seqs, logits[rows] if len(rows) != len(batch.seqs) else logits)

    def _fork_from(self, leader: Sequence, member: Sequence) -> None:
        """Member shares the leader's full blocks; copy the leader's partial last block."""
        bs = self.config.block_size
        partial = leader.num_tokens % bs
        if partial:
            self.runner.cache.copy_block(leader.block_table[-1], member.block_table[-1], partial)
        member.num_cached = leader.num_cached

    def _decode_step(self, batch: ScheduledBatch) -> list[int]:
        """One decode step with the fixed strategy, or the selector's pick; timed and logged.

        The step's own ``.tolist()`` of the sampled tokens already waits for the device, so the
        goodput measurement adds no synchronisation of its own."""
        n = len(batch.seqs)
        strategy, probe, reprobe = self.strategy, None, False
        if strategy.adaptive:
            if self.drafter is not None:
                self.selector.on_drafter_version(self.drafter.version if self._versioned else 0)
            choice = self.selector.plan(n)
            strategy, probe, reprobe = choice.strategy, choice.drafting, choice.reprobe
        # the model drafter's first step after several without it catches up on their tokens
        gap = self._model_drafter_gap if probe is not None else self._full_draft_gap
        switch = strategy.uses_model_drafter and gap >= SWITCH_GAP
        if self._mirror_config.threads is not None:
            spare = self._mirror_config.draft_threads if strategy.mirror else 0
            torch.set_num_threads(self._mirror_config.threads - spare)
        stats = self.stats
        before, model_before, draft_before = stats.generated_tokens, stats.model_time_s, stats.draft_time_s
        captured_before = capture_seconds()
        start = time.perf_counter()
        finished = self._spec_decode(batch, strategy, probe) if strategy.speculative else self._decode(batch)
        seconds = time.perf_counter() - start
        stats.decode_model_time_s += stats.model_time_s - model_before
        emitted = stats.generated_tokens - before
        if self.selector is not None and self.strategy.adaptive:
            # the arm is judged by what its steps cost once their graphs are held, not by a capture
            steady = seconds - (capture_seconds() - captured_before)
            draft_s = stats.draft_time_s - draft_before
            resumed = self.selector.observe(n, strategy, emitted, steady, probe, draft_s, switch)
            self._count_reprobe(n, strategy, reprobe, resumed)
        self._model_drafter_gap = 0 if strategy.uses_model_drafter else self._model_drafter_gap + 1
        # a probe drafts for a few sequences only: the others' drafter state still lags
        self._full_draft_gap = 0 if strategy.uses_model_drafter and probe is None else self._full_draft_gap + 1
        self._peak_active = max(self._peak_active, n)
        in_tail = n <= self.config.tail_fraction * self._peak_active
        self.stats.record_decode_step(StepRecord(n, str(strategy), emitted, seconds, in_tail))
        if not self.scheduler.has_work():
            self._peak_active = 0  # the wave is over; the next one measures its own peak
        return finished

    def _count_reprobe(self, n: int, strategy: Strategy, reprobe: bool, resumed: bool) -> None:
        """Counts a drafting arm probed again where plain decoding had won, and a step that resumed
        drafting there after such a probe (the drafter caught up, or the steps that ruled drafting
        out were slowed), which it also says."""
        self.stats.reprobes += reprobe
        if resumed:
            self.stats.reprobes_paying += 1
            logger.info(
                "adaptive: drafting (%s) resumes on %d sequences, where plain decoding had won until a "
                "periodic probe found it paying again",
                strategy,
                n,
            )

    def _propose_serially(
        self, strategy: Strategy, seqs: list[Sequence], drafting: list[bool]
    ) -> tuple[list[DraftTree], Drafter]:
        """A serial step's drafts and the drafter that made them.

        Once a mirror executor runs, chain and tree steps draft on its drafter too (``hybrid``
        keeps the in-process one its fusion wraps): serial and mirror steps then share one drafter
        state, so an adaptive engine switching between ``chain:4`` and ``mirror:chain:4`` does not
        catch a second copy of the drafter up on every token the other one drafted."""
        allocator, bs = self.runner.cache.allocator, self.config.block_size
        if self.mirror is not None and strategy.kind in ("chain", "tree"):
            return self.mirror.serial_step(seqs, strategy.shape, allocator, bs, drafting)
        drafter = self._drafter_for(strategy)
        return propose(drafter, seqs, strategy.shape, allocator, bs, drafting), drafter

    def _decode(self, batch: ScheduledBatch) -> list[int]:
        slices, tokens, positions = [], [], []
        for seq in batch.seqs:
            slices.append(SequenceSlice(seq.block_table, seq.num_cached, 1))
            tokens.append(seq.token_at(seq.num_cached))
            positions.append(seq.num_cached)
        logits = self._forward(slices, tokens, positions, list(range(len(tokens))))
        self._observe([(seq, seq.num_cached, [row], [row]) for row, seq in enumerate(batch.seqs)], logits)
        for seq in batch.seqs:
            seq.num_cached += 1
        self.stats.decode_steps += 1
        self.stats.batch_sizes.append(len(batch.seqs))
        return self._sample_and_append(batch.seqs, logits)

    @contextmanager
    def _beside(self, mirror: MirrorPipeline | None, seqs, trees, strategy: Strategy) -> Iterator[None]:
        """The verification forward with a mirror step's drafting beside it (nothing otherwise);
        eager when an early-exit hook must fire (a graph replay skips hooks)."""
        if mirror is None:
            yield
            return
        with mirror.overlap(seqs, trees, strategy), self.runner.eager() if strategy.branches else nullcontext():
            yield

    def _forward(self, slices, tokens, positions, logits_index) -> torch.Tensor:
        start = time.perf_counter()
        if self.feature_layers:
            logits, self._features = self.runner.forward_with_features(
                slices, tokens, positions, logits_index, self.feature_layers
            )
        else:
            logits = self.runner.forward(slices, tokens, positions, logits_index)
        self.stats.model_time_s += time.perf_counter() - start
        return logits

    def _observe(self, observed: list[tuple[Sequence, int, list[int], list[int]]], logits: torch.Tensor) -> None:
        """Hand a feature-reading drafter, for each ``(seq, start, rows, logit_rows)``, the last
        forward's features of ``seq``'s kept tokens (packed ``rows``) and the logits after the last
        of them (``logit_rows`` of ``logits``). One gather each for the whole batch (no per-sequence
        index tensors or device copies); nothing is gathered for drafters that read no features."""
        if not (self.feature_layers and self._features is not None and observed):
            return
        self.drafter.observe_batch(observed, self._features, logits)
        if self.mirror is not None and self.mirror.drafter is not self.drafter:  # a copy in a draft process
            try:
                self.mirror.drafter.observe_batch(observed, self._features, logits)
            except ExecutorError as e:
                self.mirror.fail(e)

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        st = BatchSamplingTensors.from_params([s.params for s in seqs], logits.device)
        logprobs = processed_logprobs(logits, st)
        uniforms = None
        if not st.all_greedy:
            uniforms = draw_uniforms([s.generator for s in seqs], self.generator).to(logits.device)
        keyed = None
        if any(s.params.position_keyed for s in seqs):
            keyed = keyed_scores(logprobs, [s.params for s in seqs], [len(s.output_ids) for s in seqs])
        chosen = choose_tokens(logprobs, st, uniforms, keyed)
        chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        finished = []
        for seq, tok, lp in zip(seqs, chosen.tolist(), chosen_lp.tolist()):
            seq.append(tok, lp)
            self.stats.generated_tokens += 1
            if seq.done:
                self._finish(seq)
                finished.append(seq.seq_id)
        return finished

    def _spec_decode(self, batch: ScheduledBatch, strategy: Strategy, probe: int | None = None) -> list[int]:
        """propose -> target forward -> verify -> accept -> commit (``rollout/spec_step.py``), then
        finish the sequences that are done; each advances by its own accepted length. A mirror
        strategy takes its drafts from the mirror pipeline and drafts the next round's during the
        forward (``rollout/mirror.py``). A ``probe`` step drafts for that many sequences only,
        spread over the batch (the selector's cheap first try of an arm on a large batch)."""
        seqs = batch.seqs
        mirror = self._ensure_mirror() if strategy.mirror else None
        if mirror is not None and mirror.failed:
            strategy, mirror = Strategy("chain" if strategy.shape.is_chain else "tree", strategy.shape), None
        allocator, bs = self.runner.cache.allocator, self.config.block_size
        start = time.perf_counter()
        drafting = drafting_mask(seqs, self.config.length_budget)
        if probe is not None:
            drafting = [d and p for d, p in zip(drafting, spread_mask(len(seqs), probe))]
        if mirror is None:
            trees, drafter = self._propose_serially(strategy, seqs, drafting)
        else:
            drafter = mirror.drafter
            trees = mirror.drafts(seqs, strategy, allocator, bs, drafting)
        drafted_at = time.perf_counter()
        slices, tokens, positions = pack_verify_batch(seqs, trees)
        bases = [seq.num_tokens for seq in seqs]
        with self._beside(mirror, seqs, trees, strategy):
            logits = self._forward(slices, tokens, positions, list(range(len(tokens))))
        verified = verify(seqs, trees, logits, [s.num_new for s in slices], self.generator)
        committed = commit(seqs, trees, verified, accept(trees, verified), self.runner.cache)
        self.stats.generated_tokens += committed.emitted
        if mirror is not None:
            mirror.settle(seqs, trees, verified.verdicts, strategy, bases)
        self._observe(committed.observed, logits)  # before finishing: a recording drafter needs every feature
        finished = []
        for seq, verdict in zip(seqs, verified.verdicts):
            if mirror is None:
                drafter.accepted(seq, len(verdict.path))
            if seq.done:
                self._finish(seq)
                finished.append(seq.seq_id)
            else:
                release_unused_blocks(seq, allocator, bs)
        self.stats.record_spec_step(
            str(strategy),
            len(seqs),
            committed.drafted,
            committed.accepted,
            committed.emitted,
            drafted_at - start,
            time.perf_counter() - drafted_at,
        )
        return finished
