"""Triton source of the split-KV paged attention (imported only when first used).

Decode and verification have few queries per sequence (1 to 1 + draft tokens) and long contexts,
so one program per (sequence, query head), as ``_triton_attention.py`` launches, leaves most of a
GPU idle at small batches and reads every K/V block once per query head of a group. Here:

* a program serves one (sequence, KV head, split): every query row of that sequence for every
  query head of the KV head's group is one row of its tile (``BLOCK_M`` >= new tokens x group), so
  each K/V block is read once per group and the scores are one ``tl.dot`` in the cache's dtype
  (fp32 accumulation);
* the context is cut into ``NUM_SPLITS`` ranges of whole ``BLOCK_N`` key blocks, each with its own
  online softmax, written as unnormalised partial outputs with their row maxima and sums;
* a second kernel merges a row's splits (log-sum-exp weights). ``NUM_SPLITS`` is a launch
  constant, so the grid is static under CUDA graphs; a split past a sequence's context writes an
  empty partial (max -inf, sum 0) that the merge weighs 0. With one split (a batch that fills the
  GPU by itself, or a short context) the first kernel writes the normalised output into a zeroed
  buffer and the merge is not launched.

Logits may be soft-capped, and a head's sink logit joins the sum where the output is normalised
(the one split, or the merge). Visibility is the paged kernel's: every cached key, among the new
tokens the causal prefix or the tree mask's ancestors, and an optional sliding window. See
``kernels/paged_attention.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_attention import block_scores, capped, kv_slots, load_kv, online_softmax_step, visible_keys, with_sink


@triton.jit
def split_kv_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,  # [T, H, D]; [slots, KVH, D] each
    part_out_ptr, part_max_ptr, part_sum_ptr,  # [S, T, H, DV] f32 unnormalised; [S, T, H] f32 each
    block_tables_ptr, cached_lens_ptr, query_lens_ptr, query_start_ptr,  # [B, max_blocks]; [B] (all i32)
    tree_mask_ptr, query_pos_ptr,  # [B, MQ, MQ] u8 (HAS_TREE); [T] i32 positions (HAS_WINDOW)
    sinks_ptr,  # [H] f32 sink logits (HAS_SINKS: added to the softmax where the output is normalised)
    scale, window, head_dim, value_dim, block_size, max_blocks, mask_q, softcap, num_rows, num_heads,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    cached = tl.load(cached_lens_ptr + b)
    q_len = tl.load(query_lens_ptr + b)
    q_start = tl.load(query_start_ptr + b)

    tile = tl.arange(0, BLOCK_M)
    token = tile // GROUP  # the new token of each tile row ...
    head = kv_head * GROUP + tile % GROUP  # ... and its query head
    row_ok = token < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    value_dims = tl.arange(0, BLOCK_DV)  # values may be of another size than keys (MLA)
    value_ok = value_dims < value_dim
    packed = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + packed[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_pos = tl.load(query_pos_ptr + packed, mask=row_ok, other=0) if HAS_WINDOW else token  # read with a window

    context = cached + q_len
    per_split = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    key_begin = split * per_split
    key_end = tl.minimum(key_begin + per_split, context)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * max_blocks
    for start in range(key_begin, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < key_end
        slots = kv_slots(table, keys, key_ok, block_size)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = load_kv(k_cache_ptr, slots, kv_head, stride_ks, stride_kh, dims, kv_mask)
        visible = visible_keys(
            keys, key_ok, token, row_ok, cached, q_pos, window, tree_mask_ptr, b, mask_q, HAS_TREE, HAS_WINDOW
        )
        scores = tl.where(visible, capped(block_scores(q, k, scale, IEEE), softcap, HAS_SOFTCAP), float("-inf"))
        v = load_kv(v_cache_ptr, slots, kv_head, stride_vs, stride_vh, value_dims, key_ok[:, None] & value_ok[None, :])
        m, denom, acc = online_softmax_step(scores, v, m, denom, acc, IEEE)

    part = (split.to(tl.int64) * num_rows + packed) * num_heads + head
    if NUM_SPLITS == 1:  # the whole context: the output itself (a row that saw no key: 0, as merged)
        if HAS_SINKS:
            acc = with_sink(m, denom, acc, tl.load(sinks_ptr + head, mask=row_ok, other=0.0))
        else:
            acc = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    at = part_out_ptr + part[:, None] * value_dim + value_dims[None, :]
    tl.store(at, acc, mask=row_ok[:, None] & value_ok[None, :])
    if NUM_SPLITS > 1:
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, denom, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    part_out_ptr,  # [S, T, H, D]: D the value size
    part_max_ptr,  # [S, T, H]
    part_sum_ptr,
    out_ptr,  # [T, H, D] f32
    sinks_ptr,  # [H] f32 (HAS_SINKS)
    num_rows,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (row, head): its splits' partials merged, the head's sink logit joining the sum. Maxima
    start at -inf (the launcher fills them), so a split that saw no key, and a row of no sequence,
    weigh 0 and their other partials (never written) are not read: such a row's output is 0."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    at = (splits.to(tl.int64) * num_rows + row) * num_heads + head
    maxima = tl.load(part_max_ptr + at)
    seen = maxima > float("-inf")
    top = tl.max(maxima, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.where(seen, tl.exp(maxima - top), 0.0)
    sums = tl.load(part_sum_ptr + at, mask=seen, other=0.0)
    total = tl.sum(weights * sums, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    parts = tl.load(
        part_out_ptr + at[:, None] * head_dim + dims[None, :], mask=seen[:, None] & dim_ok[None, :], other=0.0
    )
    merged = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (row * num_heads + head) * head_dim + dims, merged, mask=dim_ok)


__all__ = ["merge_splits_kernel", "split_kv_attention_kernel"]
