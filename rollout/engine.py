"""The rollout engine: continuous batching over a paged KV cache, driving a Hugging Face model.

Use :meth:`RolloutEngine.generate` for a batch of prompts (one completion per prompt, in
order), or the step-wise API (:meth:`add_request`, :meth:`step`) to interleave submission and
generation. Bad requests are refused with ``ValueError`` before they touch any running batch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..drafter.base import EMPTY_DRAFT, Drafter, DraftRequest, DraftTree
from ..kernels.dispatch import kernel_backend
from ..progress import progress_bar
from .attention import SequenceSlice, paged_attention_enabled
from .kv_cache import blocks_for
from .model_runner import ModelRunner
from .params import RolloutConfig, SamplingParams
from .request import FinishReason, RequestOutput, SeqStatus, Sequence
from .sampling import BatchSamplingTensors, choose_tokens, draw_uniforms, processed_logprobs
from .scheduler import ScheduledBatch, Scheduler, StepKind
from .speculative import (
    SpecStepRecord,
    fit_draft,
    keep_accepted_kv,
    max_draft_depth,
    pack_verify_batch,
    release_unused_blocks,
)
from .strategy import Strategy, parse_strategy
from .token_ids import token_id_list
from .verify import verify_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One decode step: how many sequences ran, with which strategy, what it emitted and cost."""

    num_active: int
    strategy: str
    emitted: int
    seconds: float
    in_tail: bool


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    forked_prefills: int = 0  # group members that reused a leader's prefill
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache (RolloutConfig.prefix_caching)
    mixed_steps: int = 0  # prefills that also advanced the running sequences (RolloutConfig.mixed_batches)
    model_time_s: float = 0.0
    wall_time_s: float = 0.0
    spec_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    spec_emitted_tokens: int = 0  # tokens emitted by speculative steps (accepted + one per sequence)
    spec_seq_steps: int = 0  # sequence-steps inside speculative steps
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    tail_steps: int = 0
    tail_time_s: float = 0.0
    decode_time_s: float = 0.0
    decode_model_time_s: float = 0.0  # target forwards inside decode steps (the rest: drafting and bookkeeping)
    batch_sizes: list[int] = field(default_factory=list)
    spec_log: deque[SpecStepRecord] = field(default_factory=lambda: deque(maxlen=4096))
    step_log: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=65536))
    strategy_steps: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        skip = ("batch_sizes", "spec_log", "step_log", "strategy_steps")
        d = {k: v for k, v in self.__dict__.items() if k not in skip}
        d["mean_decode_batch"] = sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0
        d["tokens_per_s"] = self.generated_tokens / self.wall_time_s if self.wall_time_s else 0.0
        d["acceptance_rate"] = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        d["mean_accept_length"] = self.spec_emitted_tokens / self.spec_seq_steps if self.spec_seq_steps else 1.0
        return d


def eos_ids_of(model: torch.nn.Module, tokenizer=None) -> frozenset[int]:
    """EOS ids from the model's generation config, falling back to its config / the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
        if ids:
            break
    return frozenset(ids)


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context length and the KV pool."""

    vocab_size: int
    max_model_len: int
    block_size: int
    total_blocks: int

    @classmethod
    def of(cls, model: torch.nn.Module, config: RolloutConfig) -> RequestLimits:
        from .model_runner import model_vocab_size

        max_len = config.max_model_len or int(getattr(model.config, "max_position_embeddings", 1 << 30))
        return cls(model_vocab_size(model), max_len, config.block_size, config.total_blocks)

    def check(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request cannot be served."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt_ids = token_id_list(prompt_ids)
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; a prompt needs at least one token")
        for i, tok in enumerate(prompt_ids):
            if not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"prompt_ids[{i}] = {tok!r} is not a token id in the vocabulary [0, {self.vocab_size})"
                )
        if params.prompt_logprobs >= len(prompt_ids):
            raise ValueError(
                f"prompt_logprobs = {params.prompt_logprobs} must be smaller than the prompt length "
                f"{len(prompt_ids)} (the first prompt token has no prediction)"
            )
        bad_stops = [s for s in params.stop_token_ids if s >= self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops} are outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt length {len(prompt_ids)} + max_new_tokens {params.max_new_tokens} = {total} "
                f"exceeds the context length max_model_len = {self.max_model_len}"
            )
        need = blocks_for(total, self.block_size)
        if need > self.total_blocks:
            raise ValueError(
                f"a request of {total} tokens needs {need} KV blocks but the pool has "
                f"{self.total_blocks}; raise RolloutConfig.num_blocks or kv_cache_tokens"
            )


def prepare_requests(
    prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None, limits: RequestLimits
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts as lists and one ``SamplingParams`` per prompt, every request checked first: one
    bad request raises ``ValueError`` naming its index (and all the others that are bad)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts is text; pass a list of token-id sequences (tokenize first)")
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        per_request = [params or SamplingParams()] * len(prompts)
    else:
        per_request = list(params)
        if len(per_request) != len(prompts):
            raise ValueError(f"got {len(per_request)} SamplingParams for {len(prompts)} prompts")
    errors = []
    for i, (p, sp) in enumerate(zip(prompts, per_request)):
        try:
            prompts[i] = token_id_list(p)
            limits.check(prompts[i], sp)
        except ValueError as e:
            errors.append(f"request {i}: {e}")
    if errors:
        raise ValueError("invalid request(s): " + "; ".join(errors))
    return prompts, per_request


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
            graph_pool=self._make_graph_pool(model),
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
        self.drafter = self._make_drafter(drafter, tokenizer)
        if self.config.prefix_caching and self.drafter is not None:
            raise ValueError(
                "prefix_caching does not work with a model drafter yet (the drafter would miss the cached "
                "prefix); use prefix_caching=False or a model-free strategy (suffix)"
            )
        self._weights_fingerprint: int | None = None
        self.suffix_drafter = self._make_suffix_drafter()
        # an EAGLE-style drafter reads target features: tap them in every forward (whatever the
        # strategy), so switching to it never needs a re-prefill
        self.feature_layers = self.drafter.feature_layers if self.drafter is not None else None
        self._features: torch.Tensor | None = None  # the last forward's taps, [T, feature_size]
        self.hybrid_drafter = None
        if self.drafter is not None:
            from ..drafter.hybrid import HybridDrafter

            self.hybrid_drafter = HybridDrafter(self.drafter, self.suffix_drafter)
        self.selector = None  # made when the strategy is "adaptive"; kept across calls (learned state)
        self._peak_active = 0
        self.strategy = Strategy("none")
        self.set_strategy(self.config.strategy)

    def _make_graph_pool(self, model: torch.nn.Module):
        from .graph_pool import CudaGraphBackend, EagerBackend, GraphPool

        backend = self.config.graph_backend
        on_cuda = next(model.parameters()).device.type == "cuda"
        if backend == "none" or (backend == "auto" and not on_cuda):
            return None
        if backend == "cuda_graph" and not on_cuda:
            raise ValueError("RolloutConfig.graph_backend='cuda_graph' needs the model on a CUDA device")
        chosen = CudaGraphBackend() if backend in ("auto", "cuda_graph") else EagerBackend()
        return GraphPool(chosen, memory_budget=self.config.graph_memory_mb << 20)

    # -- speculation set-up --------------------------------------------------------------
    def _make_drafter(self, drafter: Drafter | torch.nn.Module | None, tokenizer) -> Drafter | None:
        if drafter is None:
            return None
        from ..drafter.eagle3 import Eagle3Drafter, Eagle3Head

        if isinstance(drafter, Eagle3Head):
            drafter = Eagle3Drafter(
                drafter,
                self.model,
                kv_cache_tokens=self.config.draft_kv_cache_tokens or self.config.kv_cache_tokens,
                block_size=self.config.block_size,
                seed=self.config.seed,
            )
        elif isinstance(drafter, torch.nn.Module):
            from ..drafter.small_lm import SmallLMDrafter

            drafter = SmallLMDrafter(
                drafter,
                kv_cache_tokens=self.config.draft_kv_cache_tokens or self.config.kv_cache_tokens,
                block_size=self.config.block_size,
                seed=self.config.seed,
            )
        if not isinstance(drafter, Drafter):
            raise ValueError(f"drafter must be a tailspec Drafter or a torch.nn.Module, got {type(drafter).__name__}")
        drafter.bind(self.vocab_size, tokenizer)
        return drafter

    def _make_suffix_drafter(self) -> Drafter:
        from ..drafter.suffix import SuffixDrafter

        drafter = SuffixDrafter(history_tokens=self.config.suffix_history_tokens)
        drafter.bind(self.vocab_size)
        return drafter

    def set_strategy(self, strategy: str | Strategy) -> None:
        """Switch the speculation strategy; takes effect at the next decode step."""
        parsed = parse_strategy(strategy)
        if parsed.uses_model_drafter and self.drafter is None:
            raise ValueError(
                f"strategy {str(parsed)!r} needs a drafter model; pass drafter=... to the engine "
                "(or use 'none' or 'suffix')"
            )
        if parsed.adaptive and self.selector is None:
            from .selector import StrategySelector

            self.selector = StrategySelector(self.config.selector, has_model_drafter=self.drafter is not None)
        self.strategy = parsed

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
        self, prompt_ids: Seq[int], params: SamplingParams | None = None, *, group: int | None = None
    ) -> int:
        params = params or SamplingParams()
        prompt_ids = token_id_list(prompt_ids)
        self.validate(prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seq = Sequence(self._next_id, list(prompt_ids), params, stop_ids, group=group)
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

    def pop_output(self, request_id: int) -> RequestOutput:
        seq = self._seqs[request_id]
        if seq.status is not SeqStatus.FINISHED:
            raise ValueError(f"request {request_id} has not finished")  # and stays retrievable
        del self._seqs[request_id]
        return seq.to_output()

    def step(self) -> list[int]:
        """Run one scheduled forward; return the ids of requests that finished in it."""
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
        counts: dict[tuple[int, ...], int] = {}
        for p in prompts:
            counts[tuple(p)] = counts.get(tuple(p), 0) + 1
        groups: dict[tuple[int, ...], int] = {}
        index_of: dict[int, int] = {}  # request id -> prompt index
        for i, (p, sp) in enumerate(zip(prompts, per_request)):
            key = tuple(p)
            group = groups.setdefault(key, self.new_group()) if counts[key] > 1 else None
            index_of[self.add_request(p, sp, group=group)] = i
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
            self._store_prompt_logprobs(scored, logits[len(last) :], batch)
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

    @staticmethod
    def _store_prompt_logprobs(scored: list[tuple[Sequence, int]], span_logits: torch.Tensor, batch) -> None:
        """Unprocessed log-probabilities of each scored prompt span; a group's followers (same
        prompt) take the suffix of their leader's span that they asked for."""
        targets = [tok for seq, n in scored for tok in seq.prompt_ids[len(seq.prompt_ids) - n :]]
        target = torch.tensor(targets, device=span_logits.device).unsqueeze(-1)
        picked = torch.log_softmax(span_logits.float(), dim=-1).gather(-1, target).squeeze(-1).tolist()
        offset = 0
        for leader, n in scored:
            span = picked[offset : offset + n]
            offset += n
            for seq in [leader, *batch.followers.get(leader.seq_id, [])]:
                k = seq.params.prompt_logprobs
                if k and seq.prompt_logprobs is None:
                    seq.prompt_logprobs = span[n - k :]

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
        strategy = self.strategy
        if strategy.adaptive:
            if self.drafter is not None:
                self.selector.on_drafter_version(int(getattr(self.drafter, "version", 0)))
            strategy = self.selector.choose(n)
        before, model_before, start = self.stats.generated_tokens, self.stats.model_time_s, time.perf_counter()
        finished = self._spec_decode(batch, strategy) if strategy.speculative else self._decode(batch)
        seconds = time.perf_counter() - start
        self.stats.decode_model_time_s += self.stats.model_time_s - model_before
        emitted = self.stats.generated_tokens - before
        if self.selector is not None and self.strategy.adaptive:
            self.selector.observe(n, strategy, emitted, seconds)
        self._peak_active = max(self._peak_active, n)
        in_tail = n <= self.config.tail_fraction * self._peak_active
        st = self.stats
        st.decode_time_s += seconds
        if in_tail:
            st.tail_steps += 1
            st.tail_time_s += seconds
        name = str(strategy)
        st.strategy_steps[name] = st.strategy_steps.get(name, 0) + 1
        st.step_log.append(StepRecord(n, name, emitted, seconds, in_tail))
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

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        st = BatchSamplingTensors.from_params([s.params for s in seqs], logits.device)
        logprobs = processed_logprobs(logits, st)
        uniforms = None
        if not st.all_greedy:
            uniforms = draw_uniforms([s.generator for s in seqs], self.generator).to(logits.device)
        chosen = choose_tokens(logprobs, st, uniforms)
        chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        finished = []
        for seq, tok, lp in zip(seqs, chosen.tolist(), chosen_lp.tolist()):
            seq.append(tok, lp)
            self.stats.generated_tokens += 1
            if seq.done:
                self._finish(seq)
                finished.append(seq.seq_id)
        return finished

    def _spec_decode(self, batch: ScheduledBatch, strategy: Strategy) -> list[int]:
        """Draft, verify every sequence's draft in one target forward, advance each by its own
        accepted length (see ``rollout/verify.py`` for why the output is exactly the target's)."""
        seqs, shape = batch.seqs, strategy.shape
        assert shape is not None
        start = time.perf_counter()
        requests = [DraftRequest(seq, max_draft_depth(seq, shape)) for seq in seqs]
        asked = [r for r in requests if r.max_depth > 0]
        drafter = self._drafter_for(strategy)
        proposed = iter(drafter.propose(asked, shape) if asked else [])
        trees: list[DraftTree] = []
        allocator, bs = self.runner.cache.allocator, self.config.block_size
        for r in requests:
            tree = next(proposed) if r.max_depth > 0 else EMPTY_DRAFT
            trees.append(fit_draft(r.seq, tree, allocator, bs))
        drafted_at = time.perf_counter()

        slices, tokens, positions = pack_verify_batch(seqs, trees)
        logits = self._forward(slices, tokens, positions, list(range(len(tokens))))
        num_new = [s.num_new for s in slices]  # scored rows per sequence
        counts = torch.tensor(num_new, device=logits.device)
        st = BatchSamplingTensors.from_params([s.params for s in seqs], logits.device).repeat_interleave(counts)
        logprobs = processed_logprobs(logits, st)
        greedy = [seq.params.greedy for seq in seqs]
        if st.all_greedy:
            uniforms = torch.zeros(len(tokens), dtype=torch.float64)
        else:  # one per scored row, aligned with the rows (greedy sequences ignore theirs)
            uniforms = draw_uniforms([s.generator for s in seqs], self.generator, num_new)
        verdicts = verify_batch(trees, logprobs, greedy, uniforms)

        # the emitted tokens' logprobs of every sequence in one gather (one device sync, not one each)
        offsets = list(accumulate(num_new, initial=0))  # each sequence's first scored row
        emitted = [verdict.emitted(tree) for tree, verdict in zip(trees, verdicts)]
        packed_rows = [offsets[i] + r for i, seq_emitted in enumerate(emitted) for _, r in seq_emitted]
        packed_tokens = [t for seq_emitted in emitted for t, _ in seq_emitted]
        packed_lps = logprobs[packed_rows, packed_tokens].tolist()
        lp_starts = list(accumulate((len(e) for e in emitted), initial=0))

        finished, observed = [], []
        accepted_total = emitted_total = 0
        for i, (seq, tree, verdict) in enumerate(zip(seqs, trees, verdicts)):
            lps = packed_lps[lp_starts[i] : lp_starts[i + 1]]
            keep_accepted_kv(self.runner.cache, seq, verdict.path)
            first_position = seq.num_cached
            seq.num_cached += 1 + len(verdict.path)
            seq.num_spec_steps += 1
            seq.num_drafted += len(tree)
            seq.num_accepted += len(verdict.path)
            accepted_total += len(verdict.path)
            kept = []
            for (tok, row), lp in zip(emitted[i], lps):
                seq.append(tok, lp)
                kept.append(offsets[i] + row)
                self.stats.generated_tokens += 1
                emitted_total += 1
                if seq.done:
                    break
            observed.append((seq, first_position, kept, kept))
        self._observe(observed, logits)  # before finishing: a recording drafter needs every feature
        for seq, verdict in zip(seqs, verdicts):
            drafter.accepted(seq, len(verdict.path))
            if seq.done:
                self._finish(seq)
                finished.append(seq.seq_id)
            else:
                release_unused_blocks(seq, allocator, bs)
        end = time.perf_counter()

        drafted_total = sum(len(t) for t in trees)
        st_ = self.stats
        st_.decode_steps += 1
        st_.spec_steps += 1
        st_.batch_sizes.append(len(seqs))
        st_.drafted_tokens += drafted_total
        st_.accepted_tokens += accepted_total
        st_.spec_emitted_tokens += emitted_total
        st_.spec_seq_steps += len(seqs)
        st_.draft_time_s += drafted_at - start
        st_.verify_time_s += end - drafted_at
        st_.spec_log.append(
            SpecStepRecord(
                str(strategy),
                len(seqs),
                drafted_total,
                accepted_total,
                emitted_total,
                drafted_at - start,
                end - drafted_at,
            )
        )
        return finished
