"""Triton source of the paged attention kernel (imported only when first used).

One program handles ``BLOCK_Q`` new tokens of one sequence for one query head. It walks the
sequence's context ``BLOCK_N`` keys at a time, finding each key's slot through the block table
(any cache block size), and keeps an online softmax in fp32. A query sees every cached key and,
among the new tokens, the causal prefix or, with a tree mask, its ancestors; an optional sliding
window drops keys too far behind the query's position; logits may be soft-capped and each head
may add a sink logit to its softmax. Rows beyond a sequence's new tokens are
not written (the launcher zero-fills the output). See ``kernels/paged_attention.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def visible_keys(
    keys,
    key_ok,
    rows,
    row_ok,
    cached,
    q_pos,
    window,
    tree_mask_ptr,
    b,
    mask_q,
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Which ``keys`` (a block of context positions) each query row (its index among the
    sequence's new tokens) sees: every cached key; among the new tokens the causal prefix, or with
    a tree mask the row's ancestors; within ``window`` of the row's position if given."""
    new = keys - cached  # index among this forward's new tokens (< 0: cached)
    if HAS_TREE:
        in_new = (new >= 0) & key_ok
        allowed = tl.load(
            tree_mask_ptr + b.to(tl.int64) * mask_q * mask_q + rows[:, None] * mask_q + new[None, :],
            mask=row_ok[:, None] & in_new[None, :],
            other=0,
        )
        visible = (new[None, :] < 0) | (allowed != 0)
    else:
        visible = new[None, :] <= rows[:, None]
    visible = visible & key_ok[None, :] & row_ok[:, None]
    if HAS_WINDOW:
        visible = visible & ((q_pos[:, None] - keys[None, :]) < window)
    return visible


@triton.jit
def kv_slots(table, keys, key_ok, block_size):
    """The cache slot of each of ``keys`` (context positions), through the sequence's block table."""
    block = tl.load(table + keys // block_size, mask=key_ok, other=0)
    return block.to(tl.int64) * block_size + keys % block_size


@triton.jit
def load_kv(cache_ptr, slots, kv_head, stride_slot, stride_head, dims, mask):
    """One KV head's K (or V) rows at ``slots``, as stored."""
    return tl.load(
        cache_ptr + slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :], mask=mask, other=0.0
    )


@triton.jit
def block_scores(q, k, scale, IEEE: tl.constexpr):
    """``q @ k.T * scale``: exact fp32 products with ``IEEE`` (as the torch path computes), else the
    cache's half precision on the tensor cores with fp32 accumulation."""
    if IEEE:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q.to(k.dtype), tl.trans(k))
    return scores * scale


@triton.jit
def capped(scores, softcap, HAS_SOFTCAP: tl.constexpr):
    """``softcap * tanh(scores / softcap)`` (Gemma 2's logit cap, before the mask), tanh written
    as ``2 sigmoid(2x) - 1``; ``scores`` as they are without a cap."""
    if HAS_SOFTCAP:
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
    return scores


@triton.jit
def with_sink(m, denom, acc, sink):
    """A row's running maximum, sum and output with its head's sink logit added to the softmax: it
    takes a share of the probability and gives no value (gpt-oss). Returns the normalised output."""
    top = tl.maximum(m, sink)
    rescale = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    total = denom * rescale + tl.exp(sink - top)
    return acc * (rescale / total)[:, None]


@triton.jit
def online_softmax_step(scores, v, m, denom, acc, IEEE: tl.constexpr):
    """Folds one block of keys (``scores``, -inf where hidden, and their values ``v``) into each
    row's running maximum ``m``, sum ``denom`` and unnormalised output ``acc``; a row with nothing
    visible yet keeps m = -inf and sums 0."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    probs = tl.exp(scores - safe[:, None])
    rescale = tl.exp(m - safe)
    denom = denom * rescale + tl.sum(probs, axis=1)
    if IEEE:
        acc = acc * rescale[:, None] + tl.dot(probs, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
    return m_new, denom, acc


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,  # [T, H, D]; [slots, KVH, D] each; [T, H, D] f32
    block_tables_ptr, cached_lens_ptr, query_lens_ptr, query_start_ptr,  # [B, max_blocks]; [B] (all i32)
    tree_mask_ptr, query_pos_ptr,  # [B, MQ, MQ] u8 (HAS_TREE); [T] i32 positions (HAS_WINDOW)
    sinks_ptr,  # [H] f32 sink logits (HAS_SINKS)
    scale, window, head_dim, value_dim, block_size, max_blocks, mask_q, softcap,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_Q
    kv_head = h // GROUP
    cached = tl.load(cached_lens_ptr + b)
    q_len = tl.load(query_lens_ptr + b)
    q_start = tl.load(query_start_ptr + b)

    rows = first + tl.arange(0, BLOCK_Q)
    row_ok = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    value_dims = tl.arange(0, BLOCK_DV)  # values may be of another size than keys (MLA)
    value_ok = value_dims < value_dim
    packed_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + packed_rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q_pos = rows  # read only with a window
    if HAS_WINDOW:
        q_pos = tl.load(query_pos_ptr + packed_rows, mask=row_ok, other=0)

    # new tokens only attend to earlier new tokens (causal or ancestors), so keys end at the last row
    key_end = tl.where(first < q_len, cached + tl.minimum(q_len, first + BLOCK_Q), 0)
    m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_DV), dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * max_blocks
    for start in range(0, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < key_end
        slots = kv_slots(table, keys, key_ok, block_size)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = load_kv(k_cache_ptr, slots, kv_head, stride_ks, stride_kh, dims, kv_mask)
        visible = visible_keys(
            keys, key_ok, rows, row_ok, cached, q_pos, window, tree_mask_ptr, b, mask_q, HAS_TREE, HAS_WINDOW
        )
        scores = tl.where(visible, capped(block_scores(q, k, scale, True), softcap, HAS_SOFTCAP), float("-inf"))
        v = load_kv(v_cache_ptr, slots, kv_head, stride_vs, stride_vh, value_dims, key_ok[:, None] & value_ok[None, :])
        m, denom, acc = online_softmax_step(scores, v, m, denom, acc, True)

    if HAS_SINKS:
        out = with_sink(m, denom, acc, tl.load(sinks_ptr + h))
    else:
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        out_ptr + packed_rows[:, None] * stride_ot + h * stride_oh + value_dims[None, :],
        out,
        mask=row_ok[:, None] & value_ok[None, :],
    )


__all__ = [
    "block_scores",
    "capped",
    "with_sink",
    "kv_slots",
    "load_kv",
    "online_softmax_step",
    "paged_attention_kernel",
    "visible_keys",
]
