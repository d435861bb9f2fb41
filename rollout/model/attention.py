"""Paged attention for Hugging Face models, plugged in through ``transformers.AttentionInterface``.

One forward packs the new tokens of every sequence into a single row ``[1, T]`` with explicit
position ids. :class:`AttentionMetadata` (built once per forward, shared by all layers) says
where each new token's K/V goes in the paged cache, which cache slots each sequence attends to,
and the mask: everything already cached is visible, and among the new tokens a causal mask or,
for tree verification, any per-sequence ``[q, q]`` ancestor mask. Positions (for RoPE) are
independent of cache indices, so tree nodes at the same depth share a position.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig

from ...kernels.dispatch import SPLIT_KV_MAX_NEW, attention_suits_triton, resolve_backend
from ...kernels.paged_attention import PagedAttentionPlan, paged_attention_split_kv, paged_attention_triton
from ...kernels.transfers import to_device
from .kv_cache import PagedKVCache
from .softmax_attention import NO_EXTRAS, AttentionExtras, softmax_attention

ATTN_IMPLEMENTATION = "tailspec_paged"
METADATA_KWARG = "tailspec_attn"


@dataclass
class SequenceSlice:
    """What one sequence contributes to a forward."""

    block_table: list[int]
    num_cached: int  # tokens already in the cache before this forward
    num_new: int  # new tokens (queries) this forward
    new_token_mask: torch.Tensor | None = None  # [num_new, num_new] bool, None = causal
    state_slot: int = 0  # the sequence's slot of a recurrent model's state (0: scratch)
    draft_parents: tuple[int, ...] | None = None  # a verification's: each row's parent row (row 0: -1)


@dataclass
class AttentionMetadata:
    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] slots the new tokens' K/V are written to
    gather_slots: torch.Tensor  # [B, L] slots of each sequence's context (padded)
    mask: torch.Tensor  # [B, 1, Q, L] bool, True = attend
    query_positions: torch.Tensor  # [B, Q] positions of the (padded) queries
    num_seqs: int
    max_new: int
    query_index: torch.Tensor | None  # [B, Q] packed index of each query; None when uniform
    valid_queries: torch.Tensor | None  # [B*Q] bool; None when uniform
    plan: PagedAttentionPlan | None = None  # set when the Triton kernel attends (tailspec.kernels)
    segments: tuple | None = None  # a recurrent model's: each sequence's Segment (model/recurrent_state.py)
    draft_rows: torch.Tensor | None = None  # a verification's [S, R] parent row of each row (-1: the slot's state)
    state_slots: torch.Tensor | None = None  # a recurrent model's padded one-token forward: each row's slot [B]
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.mask
        if sliding_window not in self._window_masks:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            near = (self.query_positions.unsqueeze(-1) - keys) < sliding_window
            windowed = self.mask & near.unsqueeze(1)
            windowed[..., 0] |= ~windowed.any(dim=-1)  # padded rows keep one key (no NaNs)
            self._window_masks[sliding_window] = windowed
        return self._window_masks[sliding_window]


def attention_backend(cache: PagedKVCache, kernels: str | None, max_new: int) -> str:
    """The backend of a forward's attention over ``cache`` with at most ``max_new`` new tokens per
    sequence (``kernels``: a ``RolloutConfig.kernels`` choice, None for the enclosing one)."""
    suits = attention_suits_triton(cache.layout.dtype, max_new)
    return resolve_backend(cache.layout.device, kernels, triton_suits=suits)


def build_metadata(
    cache: PagedKVCache, seqs: Sequence[SequenceSlice], positions: torch.Tensor, kernels: str | None = None
) -> AttentionMetadata:
    """Metadata for one packed forward; ``positions`` is the packed ``[T]`` position of each token.
    ``kernels`` picks the attention backend (``tailspec.kernels.dispatch``)."""
    device = cache.layout.device
    max_new = max(s.num_new for s in seqs)
    if attention_backend(cache, kernels, max_new) == "triton":
        return _kernel_metadata(cache, seqs, positions)
    bs = cache.block_size
    num_seqs = len(seqs)
    q_lens = [s.num_new for s in seqs]
    ctx_lens = [s.num_cached + s.num_new for s in seqs]
    max_new, max_ctx = max(q_lens), max(ctx_lens)
    uniform = all(q == max_new for q in q_lens)

    max_blocks = max(len(s.block_table) for s in seqs)
    padded = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
    table = to_device(np.asarray(padded, dtype=np.int64), device)
    cached = to_device(np.asarray([s.num_cached for s in seqs], dtype=np.int64), device)
    q_len_t = to_device(np.asarray(q_lens, dtype=np.int64), device)

    keys = torch.arange(max_ctx, device=device)
    key_blocks = (keys // bs).clamp(max=max_blocks - 1).expand(num_seqs, -1)
    gather_slots = table.gather(1, key_blocks) * bs + keys % bs

    rows = torch.arange(max_new, device=device)
    new_cache_index = cached.unsqueeze(1) + rows  # [B, Q]
    valid_q = rows < q_len_t.unsqueeze(1)  # [B, Q]
    write_blocks = (new_cache_index // bs).clamp(max=max_blocks - 1)
    new_slots = table.gather(1, write_blocks) * bs + new_cache_index % bs
    slot_mapping = new_slots[valid_q] if not uniform else new_slots.reshape(-1)

    mask = _dense_mask(seqs, keys, cached, q_len_t, rows, valid_q)

    if uniform:
        query_index = valid_flat = None
        query_positions = positions.view(num_seqs, max_new)
    else:
        offsets = torch.cumsum(q_len_t, 0) - q_len_t
        query_index = torch.where(valid_q, offsets.unsqueeze(1) + rows, torch.zeros_like(rows))
        valid_flat = valid_q.reshape(-1)
        query_positions = positions[query_index]

    return AttentionMetadata(
        cache=cache,
        slot_mapping=slot_mapping,
        gather_slots=gather_slots,
        mask=mask.unsqueeze(1),
        query_positions=query_positions,
        num_seqs=num_seqs,
        max_new=max_new,
        query_index=query_index,
        valid_queries=valid_flat,
    )


def _dense_mask(
    seqs: Sequence[SequenceSlice],
    keys: torch.Tensor,
    cached: torch.Tensor,
    q_lens: torch.Tensor,
    rows: torch.Tensor,
    valid_q: torch.Tensor,
) -> torch.Tensor:
    """``[B, Q, K]``: a new token sees the cached prefix and the new tokens before it (or its
    slice's ``new_token_mask``, for draft trees); padded query rows see one key."""
    rel = keys.view(1, 1, -1) - cached.view(-1, 1, 1)  # key index relative to first new token
    in_prefix = rel < 0
    in_new = (rel >= 0) & (rel < q_lens.view(-1, 1, 1))
    mask = in_prefix | (in_new & (rel <= rows.view(1, -1, 1)))  # causal among new tokens
    for i, s in enumerate(seqs):
        if s.new_token_mask is not None:
            c0, q = s.num_cached, s.num_new
            mask[i, :q, c0 : c0 + q] = to_device(s.new_token_mask, keys.device)
    mask &= valid_q.unsqueeze(-1)
    mask[..., 0] |= ~valid_q  # padded query rows see one key, so softmax stays finite
    return mask


def _kernel_metadata(cache: PagedKVCache, seqs: Sequence[SequenceSlice], positions: torch.Tensor) -> AttentionMetadata:
    """Metadata for the Triton kernel: block tables and lengths instead of dense slots and masks."""
    device = cache.layout.device
    q_lens = [s.num_new for s in seqs]
    query_start = list(accumulate(q_lens[:-1], initial=0))
    plan = PagedAttentionPlan.build(
        [s.block_table for s in seqs],
        [s.num_cached for s in seqs],
        q_lens,
        query_start,
        positions,
        [s.new_token_mask for s in seqs],
        cache.block_size,
        device,
    )
    bs = cache.block_size
    slots = [s.block_table[i // bs] * bs + i % bs for s in seqs for i in range(s.num_cached, s.num_cached + s.num_new)]
    return AttentionMetadata(
        cache=cache,
        slot_mapping=to_device(np.asarray(slots, dtype=np.int64), device),
        gather_slots=torch.zeros(0, 0, dtype=torch.long, device=device),
        mask=torch.zeros(0, dtype=torch.bool, device=device),
        query_positions=positions.to(device),
        num_seqs=len(seqs),
        max_new=max(q_lens),
        query_index=None,
        valid_queries=None,
        plan=plan,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: write new K/V into the paged cache, attend over it.

    ``query`` is ``[1, heads, T, head_dim]`` after RoPE, ``key``/``value`` ``[1, kv_heads, T, head_dim]``
    (values may be of another size: MLA). Returns ``[1, T, heads, value size]``. ``s_aux``: one
    sink logit per head (gpt-oss); ``softcap``: logits capped to ``softcap * tanh(s / softcap)``
    before the mask (Gemma 2). Which keywords a model may pass is checked before its first
    forward (``model_support.py``). In compiled decoder layers (``RolloutConfig.compile``)
    the new K/V rows (layout change and cast) are traced, so Inductor fuses them with RoPE; their
    scatter into the cache runs with the attention, outside the compiled region: traced, the
    scatter becomes an out-of-place copy of the layer's whole cache on CUDA (two cache-sized
    kernels a layer).
    """
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs the {METADATA_KWARG!r} forward "
            "kwarg; call the model through tailspec's ModelRunner"
        )
    dtype = meta.cache.layout.dtype
    k_rows, v_rows = kv_rows(key, dtype), kv_rows(value, dtype)
    extras = AttentionExtras(s_aux, softcap) if s_aux is not None or softcap else NO_EXTRAS
    return _write_and_attend(module, query, k_rows, v_rows, meta, scaling, sliding_window, extras), None


def kv_rows(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[1, kv_heads, T, head_dim]`` keys or values as the cache's rows: ``[T, kv_heads * head_dim]``."""
    return states[0].transpose(0, 1).reshape(states.shape[2], -1).to(dtype)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor
) -> None:
    """The new tokens' K and V rows (:func:`kv_rows`) into the cache at ``slots``."""
    k_cache.view(k_cache.shape[0], -1).index_copy_(0, slots, k_rows)
    v_cache.view(v_cache.shape[0], -1).index_copy_(0, slots, v_rows)


@torch.compiler.disable  # compiled decoders fuse around it, not through it
def _write_and_attend(
    module, query, k_rows, v_rows, meta: AttentionMetadata, scaling, sliding_window, extras: AttentionExtras
) -> torch.Tensor:
    # the layer index is read here, untraced: dynamo would compile once per layer for an int
    k_cache, v_cache = meta.cache.k[module.layer_idx], meta.cache.v[module.layer_idx]
    k_row, v_row = k_cache.shape[1] * k_cache.shape[2], v_cache.shape[1] * v_cache.shape[2]  # no tensor made
    if k_rows.shape[1] != k_row or v_rows.shape[1] != v_row:
        raise RuntimeError(
            f"{type(module).__name__} (layer {module.layer_idx}) hands keys of {k_rows.shape[1]} and values of "
            f"{v_rows.shape[1]} numbers a token where the paged cache holds {k_row} and "
            f"{v_row}: its cache layout was not read right (model_support.kv_layout_of)"
        )
    write_kv(k_cache, v_cache, meta.slot_mapping, k_rows, v_rows)
    return attend(meta, k_cache, v_cache, query, scaling, sliding_window, extras)


@torch.compiler.disable  # compiled decoders fuse around it, not through it
def attend(
    meta: AttentionMetadata,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
    extras: AttentionExtras = NO_EXTRAS,
) -> torch.Tensor:
    """``query`` (``[1, heads, T, head_dim]``) over the cache (its new K/V already written):
    ``[1, T, heads, value size]``, by the Triton kernels when the metadata has their plan, else by
    gathering each sequence's context and SDPA (or, with ``extras``, :func:`softmax_attention`)."""
    num_heads, head_dim, kv_heads = query.shape[1], query.shape[3], k_cache.shape[1]
    value_dim = v_cache.shape[2]
    total = query.shape[2]
    if meta.plan is not None:
        # decode and verification (a few new tokens per sequence over a long context): the split-KV
        # kernel; prefill: one program per 16 new tokens and query head
        kernel = paged_attention_split_kv if meta.plan.max_query_len <= SPLIT_KV_MAX_NEW else paged_attention_triton
        out = kernel(
            query[0].transpose(0, 1),
            k_cache,
            v_cache,
            meta.plan,
            scaling,
            sliding_window,
            sinks=extras.sinks,
            softcap=extras.softcap,
        )  # [T, H, D]
        return out.unsqueeze(0).to(query.dtype)
    b, q = meta.num_seqs, meta.max_new
    flat_k, flat_v = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    # index_select on the 2-D view is several times faster than advanced indexing on CPU
    gather = meta.gather_slots.reshape(-1)
    keys = flat_k.index_select(0, gather).view(*meta.gather_slots.shape, kv_heads, head_dim).transpose(1, 2)
    values = flat_v.index_select(0, gather).view(*meta.gather_slots.shape, kv_heads, value_dim).transpose(1, 2)
    if meta.query_index is None:
        queries = query[0].view(num_heads, b, q, head_dim).transpose(0, 1)
    else:
        queries = query[0][:, meta.query_index].transpose(0, 1)  # [B, H, Q, D]
    mask = meta.mask_for(sliding_window)
    if extras:
        out = softmax_attention(queries.to(keys.dtype), keys, values, mask, scaling, extras)
    else:
        out = F.scaled_dot_product_attention(
            queries.to(keys.dtype), keys, values, attn_mask=mask, scale=scaling, enable_gqa=keys.shape[1] != num_heads
        )
    out = out.transpose(1, 2)  # [B, Q, H, value size]
    if meta.query_index is None:
        out = out.reshape(1, total, num_heads, value_dim)
    else:
        out = out.reshape(b * q, num_heads, value_dim)[meta.valid_queries].unsqueeze(0)
    return out.to(query.dtype)


_registered = False


def register_paged_attention() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True


_CONFIGS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[object, list[PretrainedConfig]]] = (
    weakref.WeakKeyDictionary()
)


def _configs_of(model: torch.nn.Module) -> list[PretrainedConfig]:
    """The model's configs (its submodules' too), found once per model and top-level config: a
    drafter enters paged attention at every draft, and the walk over all its modules cost more
    than the rest of entering."""
    top = getattr(model, "config", None)
    known = _CONFIGS.get(model)
    if known is not None and known[0] is top:
        return known[1]
    seen: dict[int, PretrainedConfig] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            seen.setdefault(id(cfg), cfg)
    _CONFIGS[model] = (top, list(seen.values()))
    return _CONFIGS[model][1]


@contextmanager
def paged_attention_enabled(model: torch.nn.Module) -> Iterator[None]:
    """Route the model's attention through the paged cache for the duration of the block.

    The model is shared with the trainer (colocated, zero-copy), so its own implementation is
    restored afterwards.
    """
    register_paged_attention()
    configs = _configs_of(model)
    previous = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = ATTN_IMPLEMENTATION
    try:
        yield
    finally:
        for c, impl in zip(configs, previous):
            c._attn_implementation = impl
