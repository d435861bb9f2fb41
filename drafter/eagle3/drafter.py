"""The EAGLE-3 head as an engine drafter, with its own one-layer paged KV cache.

Per sequence the drafter keeps a block table in its own pool, ``num_cached`` (positions whose
head K/V were computed from *real* target features) and the target features the engine has
observed since. Each speculative step it

1. **catches up**: runs rows ``(fc(features[t]), token[t + 1])`` at positions ``t`` from
   ``num_cached`` to the second-to-last token (one packed forward for the whole batch); the last
   row's logits give the first draft token and its hidden output feeds the next step;
2. **drafts** a chain (each step feeds back its own hidden output with the token just drafted,
   sampling from the request's processed distribution or taking the argmax, like the small-LM
   drafter) or a best-first tree (each level reruns the frontier's ancestors under a tree mask).

Draft rows are written past ``num_cached`` and overwritten at the next catch-up: their K/V came
from the head's own hidden states, not the target's, so they are never kept. A sequence the pool
cannot hold this step simply gets no draft; its features wait for the next step.

A copy can draft in another process (Mirror-SD's ``process`` and ``ray`` executors): ``rebuild``
ships the head and the target's embedding table, the engine sends each forward's feature rows
(``add_features``; ``feature_size`` floats per token), and ``load_weights`` follows training
steps of the head and of the policy's embeddings.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from ...draft_contract import (
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
    draft_on_device_else_text,
    observed_rows,
)
from ...kernels.transfers import select_rows, to_device
from ...rollout.model.attention import (
    METADATA_KWARG,
    AttentionMetadata,
    SequenceSlice,
    attention_backend,
    build_metadata,
    paged_attention_forward,
)
from ...rollout.model.device_inputs import BlockTables, TreeRows, device_inputs, static_paths
from ...rollout.model.eval_mode import eval_mode
from ...rollout.model.kv_cache import KVLayout, PagedKVCache, blocks_for
from ...rollout.model.runner import model_device_dtype
from ..draft_sampling import ChainDrafts, DeviceChainPicks, draft_chains_on_device, draft_generator
from ..tree_search import LevelInput, grow_static_trees, grow_trees
from .data import FeatureBuffer, SequenceRecorder
from .model import Eagle3Head

_MERGE_PENDING = 16  # pending feature entries merged into one tensor at this many

# A pending entry: a sequence's own feature rows, or (a whole forward's features, the sequence's rows in it)
PendingFeatures = torch.Tensor | tuple[torch.Tensor, list[int]]


def gather_pending(pending: list[PendingFeatures]) -> torch.Tensor:
    """The pending entries' feature rows, in order, as one tensor."""
    parts = []
    for entry in pending:
        if isinstance(entry, torch.Tensor):
            parts.append(entry)
            continue
        source, rows = entry
        if rows[-1] - rows[0] + 1 == len(rows):  # contiguous (always for plain decoding): a slice
            parts.append(source[rows[0] : rows[-1] + 1])
        else:
            parts.append(select_rows(source, rows))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class _HeadState:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    pending: list[PendingFeatures] = field(default_factory=list)  # features of positions num_cached .. feature_end-1
    feature_end: int = 0
    blind: bool = False  # missed some features (cannot catch up): no drafts for this sequence
    last: tuple[torch.Tensor, torch.Tensor] | None = None  # the last catch-up row's (hidden out, logits)


class Eagle3Drafter(Drafter, DraftsBranches):
    """Drafts with an :class:`Eagle3Head` for ``target`` (whose input embeddings it shares), or,
    without a target, over ``embed`` (a copy of them: what a draft process holds).

    With ``buffer`` set, every finished sequence's features and soft labels are recorded into it
    for :class:`tailspec.drafter.eagle3.train.DrafterTrainer`.
    """

    name = "eagle3"
    forks_branches = False  # one batch per branch slot; nothing speculative stays in its state

    def __init__(
        self,
        head: Eagle3Head,
        target: torch.nn.Module | None = None,
        *,
        embed: torch.nn.Module | None = None,
        kv_cache_tokens: int = 65536,
        block_size: int = 16,
        seed: int = 0,
        buffer: FeatureBuffer | None = None,
        label_topk: int = 8,
    ) -> None:
        if not (isinstance(kv_cache_tokens, int) and kv_cache_tokens >= block_size):
            raise ValueError(f"kv_cache_tokens must be an int >= block_size ({block_size}), got {kv_cache_tokens!r}")
        if (target is None) == (embed is None):
            raise ValueError("Eagle3Drafter needs exactly one of target (the model it drafts for) and embed")
        if target is not None:
            head.config.check_target(target.config)
            embed = target.get_input_embeddings()
        self.head = head
        self.embed = embed
        self.seed = seed
        self.feature_layers = tuple(head.config.aux_layer_ids)
        device, dtype = model_device_dtype(head)
        cfg = head.config
        layout = KVLayout(1, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        self.cache = PagedKVCache(layout, kv_cache_tokens // block_size, block_size)
        self.block_size = block_size
        self.generator = draft_generator(seed)
        self.target_vocab = cfg.vocab_size
        self.buffer = buffer
        self.recorder = SequenceRecorder(label_topk) if buffer is not None else None
        self._states: dict[int, _HeadState] = {}

    # -- a copy in another process (Mirror-SD draft executors) ----------------------------
    def shipped_weights(self) -> torch.nn.Module:
        """What a copy elsewhere needs and training changes: the head and the target's embeddings."""
        return torch.nn.ModuleDict({"head": self.head, "embed": self.embed})

    def rebuild(self) -> Callable[[], Eagle3Drafter]:
        """A picklable builder of a fresh drafter over copies of the head and the embedding table
        (no per-sequence state: the engine sends the features of every forward from then on)."""
        buffer = io.BytesIO()
        torch.save(self.shipped_weights(), buffer)
        kv_tokens = self.cache.allocator.num_blocks * self.block_size
        return partial(_rebuilt, buffer.getvalue(), kv_tokens, self.block_size, self.seed, self.target_vocab)

    def load_weights(self, data: bytes) -> None:
        """Replace the head's and the embeddings' weights with :func:`weights_bytes` of ``shipped_weights``."""
        device = self.cache.layout.device
        self.shipped_weights().load_state_dict(torch.load(io.BytesIO(data), map_location=device, weights_only=True))

    def add_features(self, seq_id: int, start: int, features: torch.Tensor) -> None:
        """Feature rows of positions ``start ..`` of a sequence, sent by the engine of another process."""
        self._add_pending(seq_id, start, features.shape[0], features.to(self.cache.layout.device))

    @property
    def version(self) -> int:
        """Bumped by the trainer at every optimizer step (see ``DrafterTrainer``)."""
        return self.head.version

    def fit_problems(self, target: torch.nn.Module, tokenizer=None) -> list[str]:
        return self.head.config.target_problems(target.config)

    def bind(self, vocab_size: int, tokenizer=None) -> None:
        if self.head.config.vocab_size > vocab_size:
            raise ValueError(
                f"EAGLE-3 head vocabulary {self.head.config.vocab_size} is larger than the target's {vocab_size}"
            )
        self.target_vocab = vocab_size

    # -- observations from the engine ----------------------------------------------------
    def observe(self, seq: SequenceView, start: int, features: torch.Tensor, next_logits: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.observe(seq.seq_id, len(seq.prompt_ids), start, features, next_logits)
        self._add_pending(seq.seq_id, start, features.shape[0], features)

    def observe_batch(self, observed, features: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep a reference to the forward's features and each sequence's rows (no per-sequence
        tensors or gathers on plain steps); rows are gathered at the catch-up. A recorder gets
        the batch's kept rows and the logits after them in one gather each."""
        if self.recorder is not None:
            rows, logit_rows = observed_rows(observed)
            parts = [(seq.seq_id, len(seq.prompt_ids), start, len(r), len(lr)) for seq, start, r, lr in observed]
            self.recorder.observe_batch(parts, select_rows(features, rows), select_rows(logits, logit_rows))
        for seq, start, rows, _ in observed:
            self._add_pending(seq.seq_id, start, len(rows), (features, rows))

    def _add_pending(self, seq_id: int, start: int, count: int, entry: PendingFeatures) -> None:
        state = self._states.get(seq_id)
        if state is None:  # not setdefault: that would build a state per call, and this runs per token
            state = self._states[seq_id] = _HeadState()
        if start < state.feature_end:  # recomputed (after a preemption): restart from there
            keep = max(0, start - state.num_cached)
            state.num_cached = min(state.num_cached, start)
            state.last = None
            state.pending = [gather_pending(state.pending)[:keep]] if keep and state.pending else []
            state.feature_end = start
        if start > state.feature_end:
            state.blind = True
            state.pending = []
            return
        state.pending.append(entry)
        state.feature_end = start + count
        if len(state.pending) >= _MERGE_PENDING:
            # each entry keeps a whole forward's feature tensor alive; while plain steps run,
            # hundreds of them slowed every later forward by several percent on CPU
            state.pending = [gather_pending(state.pending)]

    def finished(self, seq: SequenceView) -> None:
        if self.recorder is not None:
            sample = self.recorder.finish(seq.seq_id, seq.prompt_ids + seq.output_ids)
            if sample is not None:
                self.buffer.add(sample)

    def release(self, seq_id: int) -> None:
        if self.recorder is not None:
            self.recorder.drop(seq_id)
        state = self._states.pop(seq_id, None)
        if state is not None and state.block_table:
            self.cache.allocator.free(state.block_table)

    def _ensure_room(self, state: _HeadState, num_positions: int) -> bool:
        missing = blocks_for(num_positions, self.block_size) - len(state.block_table)
        if missing <= 0:
            return True
        if missing > self.cache.allocator.num_free:
            return False
        state.block_table += self.cache.allocator.allocate(missing)
        return True

    # -- head forwards -------------------------------------------------------------------
    def _run(
        self, slices: list[SequenceSlice], hidden: torch.Tensor, tokens: list[int] | torch.Tensor, positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed head forward over the paged cache -> (hidden out ``[T, H]``, target-vocab logits ``[T, V]``)."""
        device = self.cache.layout.device
        ids = tokens if isinstance(tokens, torch.Tensor) else to_device(np.asarray(tokens, dtype=np.int64), device)
        pos = to_device(np.asarray(positions, dtype=np.int64), device)
        return self._forward(build_metadata(self.cache, slices, pos), hidden, ids, pos)

    def _run_on_device(
        self,
        tables: BlockTables,
        cached: torch.Tensor,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        new: int,
        tree: TreeRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_run` with the lengths on the device: sequence ``i`` feeds ``new`` rows after
        ``cached[i]`` (``device_inputs``), as ``tree`` relates them, else a chain."""
        n, bs = len(tables), self.block_size
        use_plan = attention_backend(self.cache, None, new) == "triton"
        shape = (n, new, tables.longest() * bs)
        inputs, meta = device_inputs(self.cache, tables, cached, tokens, new, shape, 0, use_plan, tree)
        return self._forward(meta, hidden, tokens, inputs["pos"].view(-1))

    def _forward(
        self, meta: AttentionMetadata, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.head.midlayer.self_attn
        scale = self.head.config.head_dim**-0.5

        def attend(q, k, v):
            return paged_attention_forward(attn, q, k, v, None, scaling=scale, **{METADATA_KWARG: meta})[0]

        embeds = self.embed(ids).to(hidden.dtype).unsqueeze(0)
        out, logits = self.head(embeds, hidden.unsqueeze(0), pos.unsqueeze(0), attend)
        logits = self.head.target_logits(logits[0].float())
        if logits.shape[-1] < self.target_vocab:
            pad = logits.new_full((logits.shape[0], self.target_vocab - logits.shape[-1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
        return out[0], logits

    def _catch_up(self, seqs: list[SequenceView]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows from each sequence's ``num_cached`` to its last observed feature; returns each
        sequence's last row (hidden out, logits)."""
        slices, feats, tokens, positions, last = [], [], [], [], []
        for seq in seqs:
            state = self._states[seq.seq_id]
            n_new = state.feature_end - state.num_cached
            slices.append(SequenceSlice(state.block_table, state.num_cached, n_new))
            feats.append(gather_pending(state.pending))
            tokens.extend(seq.token_at(t + 1) for t in range(state.num_cached, state.feature_end))
            positions.extend(range(state.num_cached, state.feature_end))
            last.append(len(tokens) - 1)
            state.num_cached, state.pending = state.feature_end, []
        hidden = self.head.project(torch.cat(feats))
        out, logits = self._run(slices, hidden, tokens, positions)
        out, logits = select_rows(out, last), select_rows(logits, last)
        for row, seq in enumerate(seqs):
            self._states[seq.seq_id].last = (out[row], logits[row])
        return out, logits

    # -- drafting ------------------------------------------------------------------------
    def propose(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        extra = shape.depth if shape.is_chain else shape.depth * shape.topk
        live = []
        for r in requests:
            state = self._states.get(r.seq.seq_id)
            if (
                state is not None
                and not state.blind
                and state.feature_end == r.seq.num_tokens - 1
                and state.feature_end > state.num_cached
                and self._ensure_room(state, r.seq.num_tokens + extra)
            ):
                live.append(r)
        trees = {id(r): DraftTree() for r in requests}
        if live:
            with eval_mode(self.head), torch.no_grad():
                hidden, logits = self._catch_up([r.seq for r in live])
                if shape.is_chain:
                    drafted = self._device_chain(live, hidden, logits)
                else:
                    drafted = self._tree(live, hidden, logits, shape)
            trees.update({id(r): t for r, t in zip(live, drafted)})
        return [trees[id(r)] for r in requests]

    def propose_branches(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        """Chains for branch views (Mirror-SD): the sequence plus tokens the target is still
        verifying. The head has no target features for those, so it runs them as it runs its own
        drafts (each fed with its own hidden output), then drafts on; what it keeps is unchanged
        (rows past ``num_cached`` are overwritten at the next catch-up). A sequence appears once
        per batch (its branches would share the rows); tree shapes get no branch drafts."""
        out = [DraftTree() for _ in requests]
        if not shape.is_chain:
            return out
        batches: dict[tuple[int, int], list[int]] = {}
        slot: dict[int, int] = {}
        for i, r in enumerate(requests):
            n = slot.get(r.seq.seq_id, 0)
            slot[r.seq.seq_id] = n + 1
            batches.setdefault((n, len(r.seq.extra)), []).append(i)
        with eval_mode(self.head), torch.no_grad():
            for (_, n_extra), index in sorted(batches.items()):
                live = [i for i in index if self._can_branch(requests[i], n_extra)]
                if live:
                    for i, tree in zip(live, self._branch_chains([requests[i] for i in live], n_extra)):
                        out[i] = tree
        return out

    def _can_branch(self, request: DraftRequest, n_extra: int) -> bool:
        state = self._states.get(request.seq.seq_id)
        base = request.seq.num_tokens - n_extra
        return (
            state is not None
            and not state.blind
            and state.feature_end == base - 1
            and (state.feature_end > state.num_cached or state.last is not None)
            and self._ensure_room(state, request.seq.num_tokens + request.max_depth + 1)
        )

    def _branch_chains(self, requests: list[DraftRequest], n_extra: int) -> list[DraftTree]:
        behind = [
            r.seq for r in requests if self._states[r.seq.seq_id].feature_end > self._states[r.seq.seq_id].num_cached
        ]
        if behind:
            self._catch_up(behind)
        states = [self._states[r.seq.seq_id] for r in requests]
        hidden = torch.stack([st.last[0] for st in states])
        logits = torch.stack([st.last[1] for st in states])
        for j in range(n_extra):
            slices = [SequenceSlice(st.block_table, st.num_cached + j, 1) for st in states]
            feed = [r.seq.extra[j] for r in requests]
            hidden, logits = self._run(slices, hidden, feed, [st.num_cached + j for st in states])
        return self._chain(requests, hidden, logits, offset=n_extra)

    def _device_chain(
        self, requests: list[DraftRequest], hidden: torch.Tensor, logits: torch.Tensor
    ) -> list[DraftTree]:
        """:func:`draft_chains_on_device`, each forward fed with the head's own hidden output."""
        states = [self._states[r.seq.seq_id] for r in requests]
        carried = [hidden]

        def forward(depth: int, tokens: torch.Tensor) -> torch.Tensor:
            positions = [st.num_cached + depth - 1 for st in states]
            slices = [SequenceSlice(st.block_table, p, 1) for st, p in zip(states, positions)]
            carried[0], out = self._run(slices, carried[0], tokens, positions)
            return out

        return draft_chains_on_device(requests, logits, self.generator, forward)

    def _chain(
        self, requests: list[DraftRequest], hidden: torch.Tensor, logits: torch.Tensor, offset: int = 0
    ) -> list[DraftTree]:
        """Step by step, reading each forward's tokens: branch chains (room only for each one's own
        depth), and the reference :meth:`_device_chain` must equal."""
        chains = ChainDrafts(requests, self.generator)
        while keep := chains.extend(logits):
            hidden = hidden[keep]
            slices, feed, positions = [], [], []
            for i in chains.active:
                state = self._states[requests[i].seq.seq_id]
                position = state.num_cached + offset + len(chains.tokens[i]) - 1
                slices.append(SequenceSlice(state.block_table, position, 1))
                feed.append(chains.tokens[i][-1])
                positions.append(position)
            hidden, logits = self._run(slices, hidden, feed, positions)
        return chains.trees()

    def _tree(
        self, requests: list[DraftRequest], root_hidden: torch.Tensor, root_logits: torch.Tensor, shape: DraftShape
    ) -> list[DraftTree]:
        seqs = [r.seq for r in requests]
        node_hidden: dict[tuple[int, int], torch.Tensor] = {}  # (request, node) -> the node row's hidden out

        def score_level(inputs: list[LevelInput]) -> torch.Tensor:
            slices, hidden_in, feed, positions, index, owners = [], [], [], [], [], []
            for inp in inputs:
                i = inp.index
                state = self._states[seqs[i].seq_id]
                base = len(feed)
                slices.append(
                    SequenceSlice(state.block_table, state.num_cached, len(inp.sub), inp.sub.ancestor_mask()[1:, 1:])
                )
                for n, parent in zip(inp.keep, inp.sub.parents):
                    hidden_in.append(root_hidden[i] if parent < 0 else node_hidden[(i, inp.keep[parent])])
                    owners.append((i, n))
                feed.extend(inp.sub.tokens)
                positions.extend(state.num_cached + d - 1 for d in inp.sub.depths)
                index.extend(base + row for row in inp.frontier_rows)
            out, logits = self._run(slices, torch.stack(hidden_in), feed, positions)
            for row, key in enumerate(owners):
                node_hidden[key] = out[row]
            return torch.log_softmax(select_rows(logits, index), dim=-1)

        trees, _ = grow_trees(requests, torch.log_softmax(root_logits, dim=-1), shape, score_level)
        return trees

    def draft(self, step: DraftStep) -> list[DraftTree] | DeviceDrafts:
        """From the device's state where the step can be launched there, else from the host's text."""
        return draft_on_device_else_text(
            step, self._reserve_on_device, self._chain_on_device, self._tree_on_device, self.propose
        )

    def settled(self, seq: SequenceView, settled: Settled) -> None:
        """From the device's state, the step's kept features were just observed (positions ``cached
        .. cached + accepted``): a later step on the device ran them (``consumed``), else they wait for
        a host catch-up. From the host's text nothing changes: its catch-up runs the kept features."""
        state = self._states.get(seq.seq_id)
        if state is None or settled.cached is None:
            return
        if settled.consumed:
            state.num_cached, state.pending = state.feature_end, []
        else:
            state.num_cached = settled.cached
        state.last = None

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Nothing to cut: rows a branch drafted past ``num_cached`` are rewritten at the next catch-up."""

    def capture_missed_graphs(self) -> None:
        """Nothing to capture: the head drafts without a graph pool."""

    # -- chains and trees from state on the device ------------------------------------------
    def _reserve_on_device(self, seqs: Seq[SequenceView], lengths: Seq[int], from_host: bool) -> bool:
        """Room for each sequence's first ``lengths[i]`` tokens; from the host's state, only where
        every sequence has the features of all its tokens but the pending one, some not run yet."""
        if from_host:
            states = [self._states.get(seq.seq_id) for seq in seqs]
            if not all(
                st is not None and not st.blind and st.feature_end == seq.num_tokens - 1 > st.num_cached
                for st, seq in zip(states, seqs)
            ):
                return False
        return all(self._ensure_room(self._states[seq.seq_id], n) for seq, n in zip(seqs, lengths))

    def _root_on_device(
        self, seqs: Seq[SequenceView], inputs: DeviceDraftInputs, tables: BlockTables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up: each sequence's hidden output and logits at the row of its last kept token
        (which feeds the pending one). From the host's state the catch-up runs the pending
        features as :meth:`propose` does; from a step on the device it runs that step's ``k + 1``
        rows at its positions (the target's features there, the tokens it emitted; a tree step's
        are its accepted path's), and the rows past the last kept one write slots the next
        catch-up rewrites."""
        previous = inputs.previous
        if previous is None:
            return self._catch_up(list(seqs))
        width = previous.emitted.shape[1]
        features = previous.features.reshape(len(seqs) * width, -1)
        out, logits = self._run_on_device(
            tables, previous.cached, self.head.project(features), previous.emitted.reshape(-1), width
        )
        last = torch.arange(len(seqs), device=out.device) * width + previous.accepted
        for seq in seqs:
            self._states[seq.seq_id].last = None
        return out.index_select(0, last), logits.index_select(0, last)

    def _chain_on_device(self, inputs: DeviceDraftInputs, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Catch up (:meth:`_root_on_device`), then draft a chain, its forwards fed with the head's
        own hidden output."""
        seqs = inputs.seqs
        tables = BlockTables([self._states[seq.seq_id].block_table for seq in seqs])
        picks = DeviceChainPicks(seqs, self.generator, depth, inputs.cached)
        with eval_mode(self.head), torch.no_grad():
            hidden, logits = self._root_on_device(seqs, inputs, tables)
            token = picks.pick(logits)
            for d in range(1, depth):
                hidden, logits = self._run_on_device(tables, inputs.cached + d - 1, hidden, token, 1)
                token = picks.pick(logits)
        return picks.result()

    def _tree_on_device(self, inputs: DeviceDraftInputs, shape: DraftShape) -> tuple[torch.Tensor, torch.Tensor]:
        """Catch up, then :func:`grow_static_trees`: each level's forward runs the frontier's
        ``topk`` paths from the root as independent chains from the pending token's position (the
        row of a path's ``j``-th node at ``cached + j``, written there as scratch the next catch-up
        rewrites), each row fed the hidden output of its parent, which the level before computed
        (the root's for a path's first node)."""
        seqs = inputs.seqs
        tables = BlockTables([self._states[seq.seq_id].block_table for seq in seqs])
        with eval_mode(self.head), torch.no_grad():
            root_hidden, root_logits = self._root_on_device(seqs, inputs, tables)
            outputs: list[torch.Tensor] = []  # the last level's hidden outputs [B, k, length, H]

            def level(paths: torch.Tensor, extends: torch.Tensor | None) -> torch.Tensor:
                batch, k, length = paths.shape
                hidden_in = root_hidden.unsqueeze(1).unsqueeze(2).expand(-1, k, 1, -1)  # a path's first node
                if extends is not None:  # the later nodes: their parents' outputs, one level back
                    before = outputs.pop()
                    index = extends.view(batch, k, 1, 1).expand(-1, -1, before.shape[2], before.shape[3])
                    hidden_in = torch.cat([hidden_in, before.gather(1, index)], dim=2)
                rows = static_paths(k, length, paths.device)
                hidden_in = hidden_in.reshape(batch * k * length, -1)
                out, logits = self._run_on_device(tables, inputs.cached, hidden_in, paths.reshape(-1), k * length, rows)
                outputs.append(out.view(batch, k, length, -1))
                return torch.log_softmax(logits.view(batch * k, length, -1)[:, -1], dim=-1).view(batch, k, -1)

            return grow_static_trees(torch.log_softmax(root_logits, dim=-1), shape, level)


def _rebuilt(modules: bytes, kv_cache_tokens: int, block_size: int, seed: int, target_vocab: int) -> Eagle3Drafter:
    # whole modules (the head and the target's embedding class): bytes this run's own process made in
    # rebuild() and handed over Ray or a pipe, never a file (docs/ARCHITECTURE.md, "What is loaded from where")
    parts = torch.load(io.BytesIO(modules), map_location="cpu", weights_only=False)
    head = parts["head"].eval()
    drafter = Eagle3Drafter(
        head, embed=parts["embed"], kv_cache_tokens=kv_cache_tokens, block_size=block_size, seed=seed
    )
    drafter.target_vocab = target_vocab
    return drafter
