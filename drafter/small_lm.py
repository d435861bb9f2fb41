"""A smaller Hugging Face causal LM as the drafter, with its own paged KV cache.

Per sequence the drafter keeps a block table in its own pool and the number of the sequence's
tokens whose K/V it holds. Each step it first *catches up* (feeds the tokens it has not seen:
the prompt the first time, then the tokens the last step emitted), then drafts:

* **chain** (``topk == 1``): one token per forward. Greedy requests take the argmax; sampled
  requests sample from the drafter's processed distribution (the request's own temperature,
  top-k, top-p and min-p), which is returned as ``draft_probs`` so verification stays exact.
  The K/V of the drafted tokens stays cached and counts as valid for the accepted prefix.
* **tree** (``topk > 1``): deterministic best-first expansion by cumulative log-probability,
  EAGLE-2 style: each level expands the ``topk`` best frontier nodes into their ``topk`` best
  children, and the ``budget`` best nodes overall form the tree. A level's forward recomputes
  the frontier's ancestors under a tree mask (cheap for a small drafter), so nothing beyond the
  committed tokens is kept.

Runs on the drafter model's device and dtype; the pool never preempts: a sequence that does
not fit evicts the least recently used drafter state, or gets no draft this step.
"""

from __future__ import annotations

import io
import logging
import statistics
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from ..draft_contract import (
    DeviceDraftInputs,
    DeviceDrafts,
    Drafter,
    DraftRequest,
    DraftsBranches,
    DraftShape,
    DraftStep,
    DraftTree,
    SequenceView,
    Settled,
    TimesDraftLevels,
    draft_on_device_else_text,
    static_tree_scratch,
)
from ..kernels.transfers import read_back, select_rows
from ..rollout.adaptive.calibration import forward_timer, scratch_fit
from ..rollout.mirror.hosted import weights_bytes
from ..rollout.model.attention import SequenceSlice, paged_attention_enabled
from ..rollout.model.device_inputs import BlockTables, static_paths
from ..rollout.model.graph_pool import GraphPool
from ..rollout.model.kv_cache import blocks_for
from ..rollout.model.layer_taps import LM_HEAD_INPUT
from ..rollout.model.runner import ModelRunner
from .draft_sampling import ChainDrafts, DeviceChainPicks, draft_chains_on_device, draft_generator
from .lm_trainer import versioned_lm
from .streaming import StreamingHeads
from .tree_search import LevelPaths, grow_static_trees

logger = logging.getLogger(__name__)


@dataclass
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens of the sequence whose K/V this drafter holds
    last_used: int = 0


def vocabulary_problem(target_vocab: int, draft_vocab: int, tokens: int | None = None) -> str | None:
    """Why a drafter LM with ``draft_vocab`` output rows cannot draft for a target with
    ``target_vocab`` (None if it can): the sizes differ, unless both hold the tokenizer's
    ``tokens`` (the difference is padding rows)."""
    if draft_vocab == target_vocab:
        return None
    if tokens is None:
        return (
            f"drafter vocabulary size {draft_vocab} does not match the target's {target_vocab}; "
            "pass both tokenizers if the difference is only padding rows"
        )
    if tokens > min(draft_vocab, target_vocab):
        return (
            f"drafter vocabulary size {draft_vocab} and target's {target_vocab} cannot both hold "
            f"the tokenizer's {tokens} tokens"
        )
    return None


def check_same_vocabulary(target_vocab: int, draft_vocab: int, target_tok=None, draft_tok=None) -> None:
    """Refuse a drafter whose tokenizer or vocabulary does not match the target's."""
    both = target_tok is not None and draft_tok is not None
    if both and target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            "the drafter's tokenizer does not match the target's (different vocabularies); "
            "a drafter must share the target's tokenizer"
        )
    problem = vocabulary_problem(target_vocab, draft_vocab, len(target_tok) if both else None)
    if problem is not None:
        raise ValueError(problem)


def output_rows(model: torch.nn.Module) -> int:
    """The vocabulary a causal LM scores: its output embedding's rows (what a resize changes)."""
    return int(model.get_output_embeddings().weight.shape[0])


class SmallLMDrafter(Drafter, DraftsBranches, TimesDraftLevels):
    name = "small_lm"
    forks_branches = True
    # chains drafted on the device with one read a step (draft_chains_on_device); False: the
    # step-by-step loop that reads each forward's tokens (the reference it must equal)
    device_chains = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokenizer=None,
        kv_cache_tokens: int = 65536,
        block_size: int = 16,
        seed: int = 0,
        streaming_heads: StreamingHeads | None = None,
        graph_pool: GraphPool | None = None,
    ) -> None:
        if not (isinstance(kv_cache_tokens, int) and kv_cache_tokens >= block_size):
            raise ValueError(f"kv_cache_tokens must be an int >= block_size ({block_size}), got {kv_cache_tokens!r}")
        self.model = model
        self.lm = versioned_lm(model)  # the LM as a trained part (online training: drafter/lm_trainer.py)
        self.tokenizer = tokenizer
        self.block_size = block_size
        # with a graph pool (the engine gives one on CUDA), draft forwards replay captured graphs
        self.runner = ModelRunner(
            model, kv_cache_tokens // block_size, block_size, graph_pool=graph_pool, role=f"drafter ({self.name})"
        )
        self.allocator = self.runner.cache.allocator
        self.seed = seed
        self.generator = draft_generator(seed)
        self.target_vocab = self.runner.vocab_size
        self._states: dict[int, _DraftState] = {}
        self._clock = 0
        self._draft_base: dict[int, int] = {}  # seq_id -> num_tokens when the last draft was made
        self._next_fork = 0  # forks of a sequence's state (extra branches) get negative ids
        self.heads = streaming_heads.to(self.runner.device, self.runner.dtype).eval() if streaming_heads else None
        self._hidden: torch.Tensor | None = None  # with heads: the LM head's input at the last forward's kept rows

    def bind(self, vocab_size: int, tokenizer=None) -> None:
        check_same_vocabulary(vocab_size, self.runner.vocab_size, tokenizer, self.tokenizer)
        self.target_vocab = vocab_size

    def fit_problems(self, target: torch.nn.Module, tokenizer=None) -> list[str]:
        tokens = len(tokenizer) if tokenizer is not None else None
        problem = vocabulary_problem(output_rows(target), self.runner.vocab_size, tokens)
        return [problem] if problem is not None else []

    # -- state and KV room ---------------------------------------------------------------
    def release(self, seq_id: int) -> None:
        state = self._states.pop(seq_id, None)
        self._draft_base.pop(seq_id, None)
        if state is not None and state.block_table:
            self.allocator.free(state.block_table)

    def _ensure_room(self, seq_id: int, num_tokens: int, busy: set[int]) -> bool:
        state = self._states.setdefault(seq_id, _DraftState())
        state.last_used = self._clock
        missing = blocks_for(num_tokens, self.block_size) - len(state.block_table)
        if missing <= 0:
            return True
        if missing > self.allocator.num_free:
            idle = sorted((s.last_used, sid) for sid, s in self._states.items() if sid not in busy)
            while missing > self.allocator.num_free and idle:
                self.release(idle.pop(0)[1])
        if missing > self.allocator.num_free:
            return False
        state.block_table += self.allocator.allocate(missing)
        return True

    def _can_read(self, seq: SequenceView) -> bool:
        """False if the sequence holds a token past the drafter's embedding table (a target with a
        larger, padded vocabulary sampled a padding id): such a sequence gets no drafts."""
        state = self._states.get(seq.seq_id)
        start = min(state.num_cached, seq.num_tokens - 1) if state is not None else 0
        vocab = self.runner.vocab_size
        return all(seq.token_at(i) < vocab for i in range(start, seq.num_tokens))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        state = self._states.get(seq_id)
        self._draft_base.pop(seq_id, None)
        if state is not None:
            state.num_cached = min(state.num_cached, num_tokens)

    def propose_branches(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        """All branches in one batched draft: a sequence's first-listed branch drafts in its own
        state (which then holds it), each further branch in a fork of that state that shares the
        blocks below every branch's divergence and copies the one it diverges in; forks are
        dropped afterwards."""
        branches_of: dict[int, list[DraftRequest]] = {}
        for r in requests:
            branches_of.setdefault(r.seq.seq_id, []).append(r)
        if all(len(g) == 1 and not getattr(g[0].seq, "fork", False) for g in branches_of.values()):
            return self.propose(requests, shape)
        drafted: list[DraftRequest] = []
        forks: list[tuple[int, int]] = []  # (fork id, how many leading blocks it shares with its sequence)
        for seq_id, group in branches_of.items():
            main = self._states.get(seq_id)
            own = next((r for r in group if not getattr(r.seq, "fork", False)), None)
            if own is not None:
                drafted.append(own)
            others = [r for r in group if r is not own]
            if main is None or not others:
                continue
            keeps = [min(main.num_cached, r.seq.num_tokens - 1) for r in group]
            shared = min(keeps) // self.block_size
            for r, keep in zip(others, [k for r, k in zip(group, keeps) if r is not own]):
                copies = blocks_for(keep, self.block_size) - shared
                if copies > self.allocator.num_free:
                    continue  # no room: this branch is not drafted
                private = self.allocator.allocate(copies)
                for src, dst in zip(main.block_table[shared:], private):
                    self.runner.cache.copy_block(src, dst)
                self._next_fork -= 1
                self._states[self._next_fork] = _DraftState(main.block_table[:shared] + private, keep, self._clock)
                forks.append((self._next_fork, shared))
                drafted.append(DraftRequest(_Fork(r.seq, self._next_fork), r.max_depth))
        try:
            trees = dict(zip(map(id, drafted), self.propose(drafted, shape)))
        finally:
            for fork_id, shared in forks:
                state = self._states.pop(fork_id)
                self._draft_base.pop(fork_id, None)
                self.allocator.free(state.block_table[shared:])
        by_view = {id(d.seq.view if isinstance(d.seq, _Fork) else d.seq): trees[id(d)] for d in drafted}
        return [by_view.get(id(r.seq), DraftTree()) for r in requests]

    def rebuild(self) -> Callable[[], SmallLMDrafter]:
        """A picklable builder of a fresh drafter over a copy of this one's model (its class, config
        and weights; no state): what a draft executor in another process runs
        (``rollout/mirror/hosted.py``, which sends later weight changes with ``load_weights``)."""
        kv_tokens = self.runner.cache.allocator.num_blocks * self.block_size
        structure, weights = self.model_structure(), weights_bytes(self.model)
        heads = (self.heads.hidden_size, len(self.heads), self.heads.state_bytes()) if self.heads is not None else None
        return partial(_rebuilt, structure, weights, kv_tokens, self.block_size, self.seed, self.target_vocab, heads)

    def model_structure(self) -> Callable[[], torch.nn.Module]:
        """A picklable builder of an untrained model shaped like this drafter's (its weights load into it)."""
        return partial(_model_of, type(self.model), self.model.config, self.runner.dtype)

    @property
    def version(self) -> int:
        """Training steps of the LM and of the streaming heads: moves whenever the weights do."""
        return self.lm.version + (self.heads.version if self.heads is not None else 0)

    def shipped_weights(self) -> torch.nn.Module:
        """What a copy in a draft process follows: the model, and the streaming heads with it."""
        if self.heads is None:
            return self.model
        return torch.nn.ModuleDict({"model": self.model, "heads": self.heads})

    def load_weights(self, data: bytes) -> None:
        """Replace the weights with :func:`weights_bytes` of another copy's ``shipped_weights``."""
        self.shipped_weights().load_state_dict(
            torch.load(io.BytesIO(data), map_location=self.runner.device, weights_only=True)
        )

    def draft(self, step: DraftStep) -> list[DraftTree] | DeviceDrafts:
        """From the device's state where the step can be launched there, else from the host's text."""
        return draft_on_device_else_text(
            step, self._reserve_on_device, self._chain_on_device, self._tree_on_device, self.propose
        )

    def settled(self, seq: SequenceView, settled: Settled) -> None:
        """From the host's text: its state keeps the ``kept`` drafts of the chain it drafted (a tree
        left none). From the device's state: its state holds the sequence's tokens before ``cached +
        kept`` (the last kept one included unless a whole chain was accepted), whichever steps ran
        since; a streamed chain's last block was never fed, so none of its drafts count."""
        state, base = self._states.get(seq.seq_id), self._draft_base.pop(seq.seq_id, None)
        if state is None:
            return
        if settled.cached is not None:
            state.num_cached = settled.cached + (settled.kept if self.heads is None else 0)
        elif base is not None:
            state.num_cached = min(state.num_cached, base + settled.kept)

    # -- forward helpers -----------------------------------------------------------------
    @contextmanager
    def _inference(self) -> Iterator[None]:
        # entered at every draft: a model already in eval mode (as between training steps) is not
        # walked twice more to set and restore the mode
        # (the root's flag alone: eval_mode reads every module's, which this per-step path skips)
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            with torch.no_grad(), paged_attention_enabled(self.model):
                yield
        finally:
            if was_training:
                self.model.train()

    def capture_missed_graphs(self) -> None:
        """The drafter LM's buckets a mirror draft thread ran uncaptured, captured here."""
        if self.runner.graph_pool is not None:
            with self._inference():
                self.runner.capture_missed()

    def _logits(self, slices, tokens, positions, logits_index) -> torch.Tensor:
        if self.heads is None:
            return self._target_vocab(self.runner.forward(slices, tokens, positions, logits_index).float())
        # the LM head's input for the heads: an output of the forward, captured graphs included
        logits, hidden = self.runner.forward_with_features(slices, tokens, positions, logits_index, [LM_HEAD_INPUT])
        self._hidden = select_rows(hidden, logits_index)
        return self._target_vocab(logits.float())

    def _head_logits(self, j: int, hidden: torch.Tensor) -> torch.Tensor:
        """Streaming head ``j``'s logits (token ``t + 2 + j``) from the LM-head inputs ``hidden``."""
        return self._target_vocab(self.model.get_output_embeddings()(self.heads.hidden(j, hidden)).float())

    def _target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v_draft, v_target = logits.shape[-1], self.target_vocab
        if v_draft > v_target:
            logits = logits[:, :v_target]
        elif v_draft < v_target:
            pad = logits.new_full((logits.shape[0], v_target - v_draft), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
        return logits

    def _catch_up(self, seqs: list[SequenceView]) -> torch.Tensor:
        """Feed every sequence's unseen tokens; return the logits after each one's last token."""
        slices, tokens, positions, last = [], [], [], []
        for seq in seqs:
            state = self._states[seq.seq_id]
            new = [seq.token_at(i) for i in range(state.num_cached, seq.num_tokens)]
            slices.append(SequenceSlice(state.block_table, state.num_cached, len(new)))
            tokens.extend(new)
            positions.extend(range(state.num_cached, seq.num_tokens))
            last.append(len(tokens) - 1)
            state.num_cached = seq.num_tokens
        return self._logits(slices, tokens, positions, last)

    def draft_level_seconds(self, n: int, repeats: int) -> float | None:
        # on what the drafter's cache has free: fewer sequences than n are timed and scaled to n
        batch, context = scratch_fit(self.runner.cache.allocator.num_free, self.block_size, n, 1)
        if batch == 0:
            return None
        timer = forward_timer(self.runner, self.block_size, context)
        with self._inference():
            timer(batch, 1)  # a first run: a graph's capture, the allocator's growth
            return statistics.median(timer(batch, 1) for _ in range(repeats)) * n / batch

    # -- drafting ------------------------------------------------------------------------
    def propose(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        self._clock += 1
        busy = {r.seq.seq_id for r in requests}
        extra = shape.depth if shape.is_chain else shape.depth * shape.topk  # the widest level's forward
        live = [
            r
            for r in requests
            if self._can_read(r.seq) and self._ensure_room(r.seq.seq_id, r.seq.num_tokens + extra, busy)
        ]
        trees = {id(r): DraftTree() for r in requests}
        if live:
            with self._inference():
                seqs = [r.seq for r in live]
                # a state may hold drafted tokens beyond what was accepted: never more than the sequence
                for seq in seqs:
                    st = self._states[seq.seq_id]
                    st.num_cached = min(st.num_cached, seq.num_tokens - 1)
                root_logits = self._catch_up(seqs)
                for seq in seqs:
                    self._draft_base[seq.seq_id] = seq.num_tokens
                drafted = self._chain(live, root_logits) if shape.is_chain else self._tree(live, root_logits, shape)
            trees.update({id(r): t for r, t in zip(live, drafted)})
        return [trees[id(r)] for r in requests]

    def _chain(self, requests: list[DraftRequest], logits: torch.Tensor) -> list[DraftTree]:
        if self.heads is not None:
            return self._streamed_chain(requests, logits)
        if self.device_chains:
            return self._device_chain(requests, logits)
        chains = ChainDrafts(requests, self.generator)
        while chains.extend(logits):
            slices, feed, positions = [], [], []
            for i in chains.active:
                state = self._states[requests[i].seq.seq_id]
                slices.append(SequenceSlice(state.block_table, state.num_cached, 1))
                feed.append(chains.tokens[i][-1])
                positions.append(state.num_cached)
                state.num_cached += 1
            logits = self._logits(slices, feed, positions, list(range(len(feed))))
        return chains.trees()

    def _device_chain(self, requests: list[DraftRequest], logits: torch.Tensor) -> list[DraftTree]:
        """:func:`draft_chains_on_device`, each forward one token a sequence in its own state."""
        states = [self._states[r.seq.seq_id] for r in requests]

        def forward(depth: int, tokens: torch.Tensor) -> torch.Tensor:
            slices = [SequenceSlice(s.block_table, s.num_cached, 1) for s in states]
            positions = [s.num_cached for s in states]
            for s in states:
                s.num_cached += 1
            return self._logits(slices, tokens, positions, list(range(len(states))))

        return draft_chains_on_device(requests, logits, self.generator, forward)

    def _streamed_chain(self, requests: list[DraftRequest], logits: torch.Tensor) -> list[DraftTree]:
        """Speculative streaming: each forward's last row gives the next token (the LM head) and
        the ones after it (the streaming heads); the next forward feeds them all at once."""
        chains = ChainDrafts(requests, self.generator)
        hidden = self._hidden
        while True:
            start = {i: len(chains.tokens[i]) for i in chains.active}
            keep = chains.extend(logits)
            for j in range(len(self.heads)):
                if not keep:
                    break
                hidden = hidden[keep]
                keep = chains.extend(self._head_logits(j, hidden))
            if not chains.active:
                return chains.trees()
            slices, feed, positions, last = [], [], [], []
            for i in chains.active:
                state = self._states[requests[i].seq.seq_id]
                new = chains.tokens[i][start[i] :]
                slices.append(SequenceSlice(state.block_table, state.num_cached, len(new)))
                feed.extend(new)
                positions.extend(range(state.num_cached, state.num_cached + len(new)))
                state.num_cached += len(new)
                last.append(len(feed) - 1)
            logits = self._logits(slices, feed, positions, last)
            hidden = self._hidden

    def _tree(self, requests: list[DraftRequest], root_logits: torch.Tensor, shape: DraftShape) -> list[DraftTree]:
        """A static best-first tree from the host's state (:func:`grow_static_trees`, as a tree step on
        the device drafts it): each level's forward runs the frontier's paths after the sequence's
        tokens, nothing read until the tree is grown, then one read of it all. Each tree is cut to
        its request's depth, and nothing is drafted past a stop token."""
        states = [self._states[r.seq.seq_id] for r in requests]
        tables = BlockTables([s.block_table for s in states])
        after = torch.tensor([s.num_cached for s in states], device=root_logits.device)  # caught up to each seq
        bound = max(s.num_cached for s in states) + static_tree_scratch(shape) + 1
        level = self._paths_after(tables, after, bound)
        tokens, parents = grow_static_trees(torch.log_softmax(root_logits, dim=-1), shape, level)
        n = tokens.shape[1]
        flat_tokens, flat_parents = read_back(tokens, parents)  # flat lists: n nodes a request
        return [
            _cut(
                DraftTree(flat_tokens[i * n : (i + 1) * n], flat_parents[i * n : (i + 1) * n]),
                r.max_depth,
                r.seq.stop_ids,
            )
            for i, r in enumerate(requests)
        ]

    # -- chains and trees from state on the device ------------------------------------------
    def _reserve_on_device(self, seqs: Seq[SequenceView], lengths: Seq[int], from_host: bool) -> bool:
        """Room for each sequence's first ``lengths[i]`` tokens; from the host's state, only for
        sequences whose every token it can read."""
        if from_host and not all(self._can_read(seq) for seq in seqs):
            return False
        self._clock += 1
        busy = {seq.seq_id for seq in seqs}
        return all(self._ensure_room(seq.seq_id, n, busy) for seq, n in zip(seqs, lengths))

    def _root_on_device(
        self, seqs: Seq[SequenceView], inputs: DeviceDraftInputs, tables, bound: int, hidden: bool = False
    ) -> torch.Tensor:
        """The logits after each sequence's pending token (and with ``hidden``, the LM head's input
        there in ``self._hidden``). From the host's state the catch-up feeds the tokens the state
        lacks (the prompt, the first time). From a chain step on the device, the last two tokens at
        ``cached - 1`` and ``cached`` (the first is in the state already unless the whole last draft
        was accepted: rewriting it costs less than a ragged forward); from a tree step, whose
        forwards left scratch past its pending token, or a streamed chain, whose last block of
        drafts was never fed, every token it emitted, padded, the row at its accept length giving
        the logits. A token past this LM's embedding table (a target's padding id) is fed as the
        last row: it can only cost acceptance."""
        previous, top = inputs.previous, self.runner.vocab_size - 1
        if previous is None:  # the host's lengths are exact: catch up as propose does
            for seq in seqs:
                state = self._states[seq.seq_id]
                state.num_cached = min(state.num_cached, seq.num_tokens - 1)
            return self._catch_up(list(seqs))
        if not previous.tree and self.heads is None:
            fed = inputs.last_two.reshape(-1).clamp(max=top)
            return self._logits_on_device(tables, inputs.cached - 1, fed, 2, bound, slice(1, None, 2), hidden)
        width = previous.emitted.shape[1]
        fed = previous.emitted.reshape(-1).clamp(max=top)
        at = torch.arange(len(seqs), device=fed.device) * width + previous.accepted
        return self._logits_on_device(tables, previous.cached + 1, fed, width, bound, at, hidden)

    def _logits_on_device(
        self, tables, cached: torch.Tensor, fed: torch.Tensor, width: int, bound: int, rows, hidden: bool
    ) -> torch.Tensor:
        """The logits at ``rows`` (a slice or an index tensor) of a forward feeding ``width`` tokens a
        sequence after its ``cached`` ones, in the target's vocabulary; with ``hidden``, the LM head's
        input at those rows goes to ``self._hidden`` (what streaming heads read)."""
        taps = (LM_HEAD_INPUT,) if hidden else ()
        logits, features = self.runner.forward_on_device(tables, cached, fed, width, bound, taps)
        if hidden:
            self._hidden = features[rows]
        return self._target_vocab(logits[rows])

    def _chain_on_device(self, inputs: DeviceDraftInputs, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Catch up (:meth:`_root_on_device`), then one forward a draft token, each picked by the
        request's rule (:func:`pick_draft_tokens`, its uniforms drawn beforehand); with streaming
        heads, :meth:`_stream_on_device`."""
        seqs, bound = inputs.seqs, inputs.bound
        tables = BlockTables([self._states[seq.seq_id].block_table for seq in seqs])
        top, cached = self.runner.vocab_size - 1, inputs.cached
        picks = DeviceChainPicks(seqs, self.generator, depth, cached)
        with self._inference():
            logits = self._root_on_device(seqs, inputs, tables, bound, hidden=self.heads is not None)
            if self.heads is not None:
                return self._stream_on_device(picks, logits, tables, cached, depth, bound)
            token = picks.pick(logits)
            for d in range(1, depth):
                fed = token.clamp(max=top)
                token = picks.pick(
                    self._target_vocab(self.runner.forward_on_device(tables, cached + d, fed, 1, bound)[0])
                )
        return picks.result()

    def _stream_on_device(
        self, picks: DeviceChainPicks, logits: torch.Tensor, tables, cached: torch.Tensor, depth: int, bound: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Speculative streaming from state on the device, as :meth:`_streamed_chain` drafts on the
        host: a forward's last row gives the next token (the LM head) and the ones after it (the
        heads, from the LM head's input there); the next forward feeds that block at its
        positions. The last block is never fed, so the next step's root refeeds what was emitted."""
        top, width = self.runner.vocab_size - 1, 1 + len(self.heads)
        while True:
            block = [picks.pick(logits)]
            for j in range(len(self.heads)):
                if len(picks.tokens) == depth:
                    break
                block.append(picks.pick(self._head_logits(j, self._hidden)))
            if len(picks.tokens) == depth:
                return picks.result()
            # every fed block is whole (a short one is the last, never fed): its last row is the next root
            fed = torch.stack(block, dim=1).reshape(-1).clamp(max=top)
            start = cached + len(picks.tokens) - width + 1  # the block's first token's position
            logits = self._logits_on_device(tables, start, fed, width, bound, slice(width - 1, None, width), True)

    def _tree_on_device(self, inputs: DeviceDraftInputs, shape: DraftShape) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up, then :func:`grow_static_trees`: each level's forward runs the frontier's
        ``topk`` paths from the root as independent chains after the pending token (at ``cached +
        1 ..``, written there as scratch the next step's catch-up rewrites)."""
        seqs, bound = inputs.seqs, inputs.bound
        tables = BlockTables([self._states[seq.seq_id].block_table for seq in seqs])
        with self._inference():
            root = torch.log_softmax(self._root_on_device(seqs, inputs, tables, bound), dim=-1)
            return grow_static_trees(root, shape, self._paths_after(tables, inputs.cached + 1, bound))

    def _paths_after(self, tables: BlockTables, after: torch.Tensor, bound: int) -> LevelPaths:
        """A tree level's forward: the frontier's ``topk`` paths from the root run as independent
        chains from position ``after`` of each sequence (scratch the next catch-up rewrites), giving
        the log-probabilities after each path."""
        top = self.runner.vocab_size - 1

        def level(paths: torch.Tensor, _extends: torch.Tensor | None) -> torch.Tensor:
            batch, k, length = paths.shape
            rows = static_paths(k, length, paths.device)
            fed = paths.reshape(-1).clamp(max=top)
            logits = self.runner.forward_on_device(tables, after, fed, k * length, bound, tree=rows)[0]
            last = self._target_vocab(logits.view(batch * k, length, -1)[:, -1])
            return torch.log_softmax(last, dim=-1).view(batch, k, -1)

        return level


def _cut(tree: DraftTree, max_depth: int, stop_ids) -> DraftTree:
    """``tree`` without its nodes deeper than ``max_depth`` or below a stop token (parents precede
    children, so a kept node's parent is kept first and the kept nodes renumber in order)."""
    kept: dict[int, int] = {}
    tokens, parents = [], []
    for i, (token, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths)):
        if depth > max_depth or (parent >= 0 and (parent not in kept or tree.tokens[parent] in stop_ids)):
            continue
        kept[i] = len(tokens)
        tokens.append(token)
        parents.append(kept[parent] if parent >= 0 else -1)
    return DraftTree(tokens, parents)


class _Fork:
    """A branch view drafted in a forked state: the view under the fork's id."""

    def __init__(self, view: SequenceView, fork_id: int) -> None:
        self.view = view
        self.seq_id = fork_id

    def __getattr__(self, name: str):
        return getattr(self.view, name)


def _model_of(cls: type, config, dtype: torch.dtype) -> torch.nn.Module:
    return cls(config).to(dtype)


def _rebuilt(
    structure: Callable[[], torch.nn.Module],
    weights: bytes,
    kv_cache_tokens: int,
    block_size: int,
    seed: int,
    target_vocab: int,
    heads: tuple[int, int, bytes] | None = None,
) -> SmallLMDrafter:
    model = structure().eval()
    model.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
    streaming = StreamingHeads.from_bytes(*heads) if heads is not None else None
    drafter = SmallLMDrafter(
        model, kv_cache_tokens=kv_cache_tokens, block_size=block_size, seed=seed, streaming_heads=streaming
    )
    drafter.target_vocab = target_vocab
    return drafter
