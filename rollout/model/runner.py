"""Drives a Hugging Face causal LM over the paged KV cache.

Every forward of a rollout goes through :class:`ModelRunner`, so a captured CUDA graph (or a
native forward) replaces the model's own without touching the scheduler or the sampler. The one
other caller of the model in rollout/ is ``early_exit.exit_agreement``, which teacher-forces
whole sequences outside any rollout to measure an exit layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import numpy as np
import torch

from ...kernels.dispatch import kernel_backend
from ...kernels.transfers import to_device
from .attention import (
    METADATA_KWARG,
    AttentionMetadata,
    SequenceSlice,
    attention_backend,
    build_metadata,
    paged_attention_enabled,
)
from .bucket_rows import put_rows, take_rows
from .cast_copy import rollout_model, weights_fingerprint
from .compiled import CompiledLayers
from .device_inputs import BlockTables, device_inputs
from .eval_mode import eval_mode
from .graph_pool import GraphKey, GraphPool
from .kv_cache import PagedKVCache
from .layer_taps import decoder_layers, features_of, tapped
from .merged_projections import MergedProjections
from .missed_captures import capture_missed
from .model_support import check_model, kv_layout_of, recurrent_states_for
from .padded_metadata import build_padded_metadata, padded_rows
from .recurrent_state import (
    padded_slots,
    padded_verification_inputs,
    recurrent_state_enabled,
    replayable,
    segments_of,
    verification_segments,
)

# a packed forward as the step loop and calibration call it (ModelRunner.forward, or a wrapper of
# it): sequences, their new tokens, those tokens' positions, the rows whose logits to return
Forward = Callable[[Sequence[SequenceSlice], list[int] | torch.Tensor, list[int], list[int]], torch.Tensor]

logger = logging.getLogger(__name__)


def model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


def model_vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


class ModelRunner:
    """Packed forwards over the paged cache. With a :class:`GraphPool`, decode and verification
    forwards (few new tokens per sequence), tapped hidden states included, are padded to a bucket
    and replayed from the pool; prefills run eagerly."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        graph_pool: GraphPool | None = None,
        cache_prefixes: bool = False,
        compile_layers: bool = False,
        merge_projections: bool = False,
        dtype: str = "auto",
        role: str = "policy",
        state_slots: int = 0,
    ) -> None:
        check_model(model, role)  # a family it cannot decode exactly is refused before any forward
        self.model, self.cast = rollout_model(model, dtype)  # decodes on a copy in another dtype if asked
        model = self.model
        self.states = recurrent_states_for(model, role, state_slots, graph_pool)
        self.device, self.dtype = model_device_dtype(model)
        self.vocab_size = model_vocab_size(model)
        self.layout = kv_layout_of(model, self.dtype, self.device)
        self.graph_pool = graph_pool
        # one extra block: padding rows of captured forwards write their K/V there
        self.cache = PagedKVCache(
            self.layout, num_blocks + (1 if graph_pool is not None else 0), block_size, cache_prefixes
        )
        self.scratch_slot = self.cache.allocator.allocate(1)[0] * block_size if graph_pool is not None else -1
        self.compiled = CompiledLayers(decoder_layers(model)) if compile_layers else None
        self.merged = MergedProjections(decoder_layers(model)) if merge_projections else None
        self._weights_fingerprint: int | None = None
        self._weights_at: tuple[int, ...] | None = None  # where the weights were when graphs were captured
        self._in_inference = False

    def drop_stale_prefixes(self) -> None:
        """Cached K/V is only valid for the weights that computed it: forget it when any parameter
        was replaced or changed in place (optimizer steps and ``load_state_dict`` bump tensor
        version counters)."""
        fingerprint = weights_fingerprint(self.model.parameters())
        if fingerprint != self._weights_fingerprint:
            if self._weights_fingerprint is not None:
                self.cache.allocator.clear_prefixes()
            self._weights_fingerprint = fingerprint

    def weights_changed(self) -> None:
        """The model's weights changed in a way their version counters may not show: torch's fused
        AdamW (transformers' default optimizer since torch 2.8) updates parameters in place without
        bumping them. What was derived from the weights is made again: the cast copy and the merged
        projections at the next forward, and cached prefixes now."""
        if self.cast is not None:
            self.cast.forget()
        if self.merged is not None:
            self.merged.forget()
        self.cache.allocator.clear_prefixes()

    def release_memory(self) -> None:
        """Free the KV cache and the captured graphs (which read its tensors); nothing may run until
        :meth:`restore_memory`. The weights stay: a server whose trainer needs the device between
        rollouts (verl's sleep) frees what decoding alone holds."""
        if self.graph_pool is not None:
            self.graph_pool.clear()
        self.cache.release()

    def restore_memory(self) -> None:
        self.cache.restore()

    def forget_graphs_of_moved_weights(self) -> None:
        """A captured graph reads each weight at the address it was captured with. Changes in place
        (optimizer steps) it sees; a weight that moved (ZeRO-3 gathers the parameters anew for each
        rollout; ``model.to``, ``load_state_dict(assign=True)``, DeepSpeed flattening them after the
        engine was made) it would not: then the pool's graphs are dropped and captured again. (A
        drafter LM's weights change only in place, ``load_weights`` copies: its pool is not checked,
        which would cost a pass over its parameters at every draft.)"""
        if self.graph_pool is None:
            return
        where = tuple(p.data_ptr() for p in self.model.parameters())
        if self.merged is not None:
            where += self.merged.data_ptrs()
        held = self.graph_pool.keys()
        if self._weights_at not in (None, where) and held:
            logger.info("the model's weights moved: %d captured graphs dropped", len(held))
            self.graph_pool.clear()
        self._weights_at = where

    @contextmanager
    def inference(self, kernels: str) -> Iterator[None]:
        """no_grad + eval mode + paged attention (the ``kernels`` backend, the merged projections
        and the compiled decoder layers if asked) for the model, restored afterwards. Re-entrant: a front end enters it
        around its steps, so a step inside pays nothing."""
        if self._in_inference:
            yield
            return
        self._in_inference = True
        try:
            compiled = self.compiled.active() if self.compiled is not None else nullcontext()
            merged = self.merged.active() if self.merged is not None else nullcontext()
            states = recurrent_state_enabled(self.model, self.states) if self.states is not None else nullcontext()
            with eval_mode(self.model), torch.no_grad(), paged_attention_enabled(self.model), kernel_backend(kernels):
                with merged, compiled, states:
                    if self.cast is not None:
                        self.cast.refresh()  # the source's weights as they are now (an optimizer stepped)
                    self.forget_graphs_of_moved_weights()
                    yield
        finally:
            self._in_inference = False

    def forward(
        self,
        seqs: Sequence[SequenceSlice],
        tokens: list[int] | torch.Tensor,
        positions: list[int],
        logits_index: list[int],
    ) -> torch.Tensor:
        """Run one packed forward and return the logits of the packed positions ``logits_index``;
        ``tokens`` may be a tensor on the device (a greedy draft's, never read back)."""
        return self._forward(seqs, tokens, positions, logits_index, ())[0]

    def forward_with_features(
        self,
        seqs: Sequence[SequenceSlice],
        tokens: list[int],
        positions: list[int],
        logits_index: list[int],
        feature_layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, plus the hidden states entering ``feature_layers`` for every packed
        token, concatenated in the given order: ``[T, len(feature_layers) * hidden]``. Captured
        like any forward (the features are an output of the graph), so an EAGLE-3 drafter's target
        replays its graphs instead of decoding eagerly, which costs some 20x more a step on a GPU."""
        logits, features = self._forward(seqs, tokens, positions, logits_index, tuple(feature_layers))
        assert features is not None
        return logits, features

    def _forward(
        self, seqs: Sequence[SequenceSlice], tokens: list[int], positions: list[int], logits_index: list[int], taps
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = self.graph_key(len(seqs), max(s.num_new for s in seqs), max(s.num_cached + s.num_new for s in seqs))
        if key is not None and (self.states is None or replayable(seqs)):
            return self._forward_padded(seqs, tokens, positions, logits_index, replace(key, taps=taps))
        ids = tokens if isinstance(tokens, torch.Tensor) else to_device(np.asarray(tokens, dtype=np.int64), self.device)
        pos = to_device(np.asarray(positions, dtype=np.int64), self.device)
        keep = to_device(np.asarray(logits_index, dtype=np.int64), self.device)
        meta = build_metadata(self.cache, seqs, pos)
        if self.states is not None:
            meta.segments, meta.draft_rows = segments_of(seqs, self.device)
        with tapped(self.model, taps) as captured:
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=pos.unsqueeze(0),
                use_cache=False,
                logits_to_keep=keep,
                **{METADATA_KWARG: meta},
            )
        return out.logits[0], features_of(captured, taps)

    def forward_on_device(
        self,
        tables: BlockTables,
        cached: torch.Tensor,
        ids: torch.Tensor,
        new: int,
        bound: int,
        taps=(),
        tree=None,
        slots: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[len(tables) * new, vocab]`` logits of a forward whose lengths are on the device
        (``device_inputs.py``; sequence ``i`` feeds ``ids[i * new : (i + 1) * new]`` after its
        ``cached[i]`` tokens, as ``tree`` relates them, else a chain; ``bound`` caps every ``cached[i]
        + new``), and the inputs of the ``taps`` layers (None without), from the graph pool if it can;
        ``slots``: a recurrent model's sequences' state slots (the forward verifies drafts: each row's
        state is kept until the verification keeps one)."""
        n, bs, taps = len(tables), self.cache.block_size, tuple(taps)
        key = self.graph_key(n, new, bound) if self.states is None or self.states.verifications_replayable else None
        if key is None:
            shape = (n, new, tables.longest() * bs)
            backend = attention_backend(self.cache, None, new)
            inputs, meta = device_inputs(self.cache, tables, cached, ids, new, shape, 0, backend == "triton", tree)
            if self.states is not None:
                meta.segments, meta.draft_rows = verification_segments(slots, new, tree, self.device)
            with tapped(self.model, taps) as captured:
                out = self.model(
                    input_ids=inputs["ids"], position_ids=inputs["pos"], use_cache=False, **{METADATA_KWARG: meta}
                )
            return out.logits[0], features_of(captured, taps)
        key = replace(key, taps=taps)
        use_plan = attention_backend(self.cache, None, key.tokens) == "triton"
        shape, scratch = (key.batch, key.tokens, key.context), self.scratch_slot // bs
        inputs, meta = device_inputs(self.cache, tables, cached, ids, new, shape, scratch, use_plan, tree)
        if self.states is not None:  # a verification: each row's parent row, its rows' states kept
            parents = verification_segments(slots, new, tree, self.device)[1]
            inputs.update(padded_verification_inputs(slots, parents, key.batch, key.tokens))
        out = self.graph_pool.run(key, self._padded_forward_fn(meta, key), inputs)
        if self.states is not None:
            self.states.replayed(key.batch, key.tokens)
        logits, features = out if taps else (out, None)
        rows = (np.arange(n)[:, None] * key.tokens + np.arange(new)).reshape(-1)
        return take_rows(logits, rows), None if features is None else take_rows(features, rows)

    def graph_key(self, num_seqs: int, tokens: int, context: int, kernels: str | None = None) -> GraphKey | None:
        """The graph bucket a forward of ``num_seqs`` sequences, ``tokens`` new tokens each and
        contexts up to ``context`` replays, or None where it runs uncaptured (no pool, or larger
        than its buckets); ``kernels``: a ``RolloutConfig.kernels`` choice, None for the enclosing one."""
        pool = self.graph_pool
        key = pool.key_for(num_seqs, tokens, context) if pool is not None else None
        if key is None:
            return None
        if attention_backend(self.cache, kernels, key.tokens) == "triton":
            return pool.key_for(num_seqs, tokens, context, reads_tables=True)
        return key

    def padded_inputs(
        self, seqs: Sequence[SequenceSlice], tokens: list[int], positions: list[int], key: GraphKey
    ) -> tuple[dict[str, torch.Tensor], AttentionMetadata, np.ndarray]:
        """The host's work before a replay of bucket ``key``: the padded forward's inputs (token
        ids, positions, attention metadata) on the host, where the graph pool copies them to the
        device in one copy per dtype, its metadata, and each packed token's padded row."""
        b, q = key.batch, key.tokens
        valid = padded_rows(seqs, b, q)
        meta = build_padded_metadata(
            self.cache, seqs, positions, b, q, key.context, self.scratch_slot, valid=valid, device="cpu"
        )
        if isinstance(tokens, torch.Tensor):  # on the device: placed there, never read back
            ids = put_rows(tokens, np.flatnonzero(valid), b * q).view(1, -1)
        else:
            host_ids = np.zeros((b, q), dtype=np.int64)
            host_ids[valid] = np.asarray(tokens, dtype=np.int64)
            ids = torch.from_numpy(host_ids).view(1, -1)
        inputs = {
            "ids": ids,
            "pos": meta.query_positions.view(1, -1),  # each row's position: the model's position ids
            "slot_mapping": meta.slot_mapping,
            "gather_slots": meta.gather_slots,
            "mask": meta.mask,
            "query_positions": meta.query_positions,
        }
        if meta.plan is not None:
            inputs.update({f"plan.{k}": v for k, v in meta.plan.tensors().items()})
        if self.states is not None:
            inputs["state_slots"] = padded_slots(seqs, b)
        return inputs, meta, np.flatnonzero(valid)

    def _forward_padded(self, seqs, tokens, positions, logits_index, key) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward padded to ``key`` and replayed from the graph pool."""
        inputs, meta, row_of = self.padded_inputs(seqs, tokens, positions, key)
        # [b * q, vocab] (and [b * q, features]), overwritten by the next replay of any graph
        out = self.graph_pool.run(key, self._padded_forward_fn(meta, key), inputs)
        logits, features = out if key.taps else (out, None)
        if features is not None:
            features = take_rows(features, row_of)
        return take_rows(logits, row_of[np.asarray(logits_index, dtype=np.int64)]), features

    def capture_missed(self) -> int:
        """Capture the buckets a draft executor's thread ran uncaptured (``missed_captures.py``)."""
        return capture_missed(
            self.graph_pool, self.cache, self.scratch_slot, self.padded_inputs, self._padded_forward_fn
        )

    def _padded_forward_fn(self, meta: AttentionMetadata, key: GraphKey) -> Callable[[], Callable]:
        """What the graph pool captures for bucket ``key``: the model's forward on the static
        inputs (``meta``'s plan, if any, supplies the attention's non-tensor fields)."""
        b, q = key.batch, key.tokens

        def make_fn():
            cache, model, plan, taps = self.cache, self.model, meta.plan, key.taps

            def fn(x):
                static_plan = None
                if plan is not None:
                    static_plan = plan.with_tensors({k[5:]: v for k, v in x.items() if k.startswith("plan.")})
                static = AttentionMetadata(
                    cache,
                    x["slot_mapping"],
                    x["gather_slots"],
                    x["mask"],
                    x["query_positions"],
                    b,
                    q,
                    None,
                    None,
                    plan=static_plan,
                    state_slots=x.get("state_slots"),
                    draft_rows=x.get("state_parents"),
                )
                with tapped(model, taps) as captured:
                    out = model(input_ids=x["ids"], position_ids=x["pos"], use_cache=False, **{METADATA_KWARG: static})
                return (out.logits[0], features_of(captured, taps)) if taps else out.logits[0]

            return fn

        return make_fn

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Within the block, forwards run eagerly (hooks only fire in eager forwards)."""
        pool, self.graph_pool = self.graph_pool, None
        try:
            yield
        finally:
            self.graph_pool = pool
