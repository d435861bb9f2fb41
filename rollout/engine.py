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
from contextlib import contextmanager

import torch

from ..draft_contract import Drafter, DraftTree, Stateful, Versioned, drafter_factory
from ..kernels.dispatch import kernel_backend
from . import serving
from .admission import RequestLimits, eos_ids_of, prepare_requests
from .attention import SequenceSlice, paged_attention_enabled
from .draft_executor import DraftExecutor
from .graph_pool import capture_seconds, graph_pool_for
from .handoff import PartialRequest, RequestInbox, ServeUpdate
from .length_budget import drafting_mask, spread_mask
from .mirror import MirrorPipeline
from .mirror_slot import MirrorSlot
from .model_runner import ModelRunner
from .params import RolloutConfig, SamplingParams
from .position_noise import keyed_scores
from .request import FinishReason, RequestOutput, SeqStatus, Sequence
from .sampling import BatchSamplingTensors, choose_tokens, draw_uniforms, processed_logprobs, store_prompt_logprobs
from .scheduler import ScheduledBatch, Scheduler, StepKind
from .selector import StrategySelector
from .spec_step import accept, commit, propose, verify
from .speculative import pack_verify_batch, release_unused_blocks
from .stats import EngineStats, StepRecord
from .strategy import Strategy
from .strategy_choice import StepPlan, StrategyChoice
from .token_ids import token_id_list

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
        versioned = self.drafter if isinstance(self.drafter, Versioned) else None
        version = (lambda: versioned.version) if versioned is not None else (lambda: 0)
        self.choice = StrategyChoice(self.config, self.drafter is not None, version if self.drafter else None)
        self.mirrors = MirrorSlot(model, self.drafter, self.config.mirror)
        self._peak_active = 0
        self.set_strategy(self.config.strategy)

    # -- speculation set-up --------------------------------------------------------------
    def set_strategy(self, strategy: str | Strategy) -> None:
        """Switch the speculation strategy; takes effect at the next decode step."""
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
        return self.mirrors.hostable(self.choice.arms, bool(self.feature_layers))

    def use_draft_executor(self, executor: DraftExecutor | None) -> None:
        """Mirror steps draft on ``executor`` (a :class:`PeerExecutor`: another worker's draft host)
        from the next step on; None: on the engine's own executor again. Safe to call from another
        thread: the switch happens between steps."""
        self.mirrors.use_executor(executor)

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

    def _drafter_for(self, strategy: Strategy) -> Drafter:
        if strategy.kind == "suffix":
            return self.suffix_drafter
        return self.hybrid_drafter if strategy.kind == "hybrid" else self.drafter

    # -- step-wise API -------------------------------------------------------------------
    def validate(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request cannot be served."""
        self.limits.check(prompt_ids, params)

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

    def discard(self, request_id: int) -> None:
        """Abort a request and drop it, finished or not (a front end's caller stopped early)."""
        self.abort(request_id)
        self._seqs.pop(request_id, None)

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
        self.mirrors.release(seq.seq_id)

    def pop_output(self, request_id: int) -> RequestOutput:
        seq = self._seqs[request_id]
        if seq.status is not SeqStatus.FINISHED:
            raise ValueError(f"request {request_id} has not finished")  # and stays retrievable
        del self._seqs[request_id]
        return seq.to_output()

    def step(self) -> list[int]:
        """Run one scheduled forward; return the ids of requests that finished in it."""
        if self.mirrors.switch_pending:
            alive = [s.seq_id for s in self._seqs.values() if s.status is not SeqStatus.FINISHED]
            self.mirrors.switch_between_steps(alive, self.mirror_capable)
        if self.config.prefix_caching and self.scheduler.waiting:  # only admission reads the cache
            self._drop_stale_prefixes()
        mixed = self.config.mixed_batches and not self.strategy.speculative and not self.strategy.adaptive
        batch = self.scheduler.schedule(mixed=mixed)
        if batch is None:
            return []
        with self.inference():
            if batch.kind is StepKind.DECODE:
                finished = self._decode_step(batch)
            else:  # PREFILL, or MIXED: a running sequence is a prompt with one uncached token
                finished = self._prefill(batch)
                self.stats.mixed_steps += batch.kind is StepKind.MIXED
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens
        return finished

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
    def inference(self) -> Iterator[None]:
        """no_grad + eval mode + paged attention for the model, restored afterwards.

        Re-entrant: the front ends enter it around their steps, so ``step`` pays nothing inside.
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
        """One decode step with the strategy :class:`StrategyChoice` plans; timed and logged.

        The step's own ``.tolist()`` of the sampled tokens already waits for the device, so the
        goodput measurement adds no synchronisation of its own."""
        n, stats = len(batch.seqs), self.stats
        plan = self.choice.plan(n)
        self.mirrors.split_threads(plan.strategy)
        before, model_before, draft_before = stats.generated_tokens, stats.model_time_s, stats.draft_time_s
        captured_before = capture_seconds()
        start = time.perf_counter()
        finished = self._spec_decode(batch, plan) if plan.strategy.speculative else self._decode(batch)
        seconds = time.perf_counter() - start
        stats.decode_model_time_s += stats.model_time_s - model_before
        emitted = stats.generated_tokens - before
        # the arm is judged by what its steps cost once their graphs are held, not by a capture
        steady = seconds - (capture_seconds() - captured_before)
        self.choice.record(plan, n, emitted, steady, stats.draft_time_s - draft_before, stats)
        self._peak_active = max(self._peak_active, n)
        in_tail = n <= self.config.tail_fraction * self._peak_active
        stats.record_decode_step(StepRecord(n, str(plan.strategy), emitted, seconds, in_tail))
        if not self.scheduler.has_work():
            self._peak_active = 0  # the wave is over; the next one measures its own peak
        return finished

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
        self.mirrors.observe(observed, self._features, logits)

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

    def _spec_decode(self, batch: ScheduledBatch, plan: StepPlan) -> list[int]:
        """propose -> target forward -> verify -> accept -> commit (``rollout/spec_step.py``), then
        finish the sequences that are done; each advances by its own accepted length. A mirror
        strategy takes its drafts from the mirror pipeline and drafts the next round's during the
        forward (``rollout/mirror.py``). A ``plan.probe`` step drafts for that many sequences only,
        spread over the batch (the selector's cheap first try of an arm on a large batch)."""
        seqs, allocator, bs = batch.seqs, self.runner.cache.allocator, self.config.block_size
        strategy, mirror = self.mirrors.for_step(plan.strategy)
        start = time.perf_counter()
        drafting = drafting_mask(seqs, self.config.length_budget)
        if plan.probe is not None:
            drafting = [d and p for d, p in zip(drafting, spread_mask(len(seqs), plan.probe))]
        trees, drafter = self._drafts(strategy, mirror, seqs, drafting)
        drafted_at = time.perf_counter()
        slices, tokens, positions = pack_verify_batch(seqs, trees)
        bases = [seq.num_tokens for seq in seqs]
        with self.mirrors.beside(mirror, self.runner, seqs, trees, strategy):
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
        draft_s, verify_s = drafted_at - start, time.perf_counter() - drafted_at
        self.stats.record_spec_step(
            str(strategy), len(seqs), committed.drafted, committed.accepted, committed.emitted, draft_s, verify_s
        )
        return finished

    def _drafts(
        self, strategy: Strategy, mirror: MirrorPipeline | None, seqs: list[Sequence], drafting: list[bool]
    ) -> tuple[list[DraftTree], Drafter]:
        """A step's drafts and the drafter that made them: the mirror pipeline's for a mirror step,
        else serially, on the running pipeline's drafter where one runs (``MirrorSlot.serial_drafts``)."""
        allocator, bs = self.runner.cache.allocator, self.config.block_size
        if mirror is not None:
            return mirror.drafts(seqs, strategy, allocator, bs, drafting), mirror.drafter
        shared = self.mirrors.serial_drafts(strategy, seqs, allocator, bs, drafting)
        if shared is not None:
            return shared
        drafter = self._drafter_for(strategy)
        return propose(drafter, seqs, strategy.shape, allocator, bs, drafting), drafter
