"""Paged attention over the block tables, for prefill, decode and tree verification.

:class:`PagedAttentionPlan` describes one packed forward the way the kernel reads it: per
sequence a block table, how many tokens were cached before the forward, how many new tokens
(queries) it has and where they start in the packed rows, and optionally a ``[Q, Q]`` mask among
the new tokens (tree verification; default causal). :func:`paged_attention_reference` is the
plain torch definition; :func:`paged_attention_triton` launches the Triton kernel. The engine's
own torch path (``tailspec.rollout.model.attention``, gather + SDPA) computes the same function.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .transfers import to_device

PLAN_TENSORS = ("block_tables", "cached_lens", "query_lens", "query_start", "query_positions", "tree_mask")


@functools.cache
def _causal(size: int) -> np.ndarray:
    """``[size, size]`` uint8 lower triangle (read-only: shared by every plan of that size)."""
    mask = np.tril(np.ones((size, size), dtype=np.uint8))
    mask.flags.writeable = False
    return mask


@dataclass
class PagedAttentionPlan:
    block_tables: torch.Tensor  # [B, max_blocks] int32
    cached_lens: torch.Tensor  # [B] int32
    query_lens: torch.Tensor  # [B] int32
    query_start: torch.Tensor  # [B] int32
    query_positions: torch.Tensor  # [T] int32, for sliding windows
    tree_mask: torch.Tensor | None  # [B, MQ, MQ] uint8 among new tokens; None = causal
    block_size: int
    max_query_len: int

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        query_lens: Sequence[int],
        query_start: Sequence[int],
        query_positions: torch.Tensor,
        tree_masks: Sequence[torch.Tensor | None],
        block_size: int,
        device: torch.device,
        mask_size: int | None = None,
    ) -> PagedAttentionPlan:
        """``block_tables`` may be ragged (padded here with block 0) or a ``[B, blocks]`` array.
        ``mask_size`` materialises a ``[B, mask_size, mask_size]`` mask (causal where no tree)
        even without trees, so a captured graph sees inputs of one shape whatever the step holds."""
        if isinstance(block_tables, np.ndarray) and block_tables.ndim == 2 and block_tables.shape[1] >= 1:
            table = block_tables.astype(np.int32)  # a captured bucket's padded tables: no loop over rows
        else:
            max_blocks = max(1, max(len(t) for t in block_tables))
            table = np.zeros((len(block_tables), max_blocks), dtype=np.int32)
            for i, t in enumerate(block_tables):
                table[i, : len(t)] = t
        max_q = mask_size or max(1, max(query_lens))
        tree_mask = None
        if mask_size is not None or any(m is not None for m in tree_masks):
            # numpy: torch's CPU tril spreads a few rows over every intra-op thread, and waking
            # them costs milliseconds a call on a many-core host
            masks = np.broadcast_to(_causal(max_q), (len(block_tables), max_q, max_q)).copy()
            for i, m in enumerate(tree_masks):
                if m is not None:
                    q = m.shape[0]
                    masks[i, :q, :q] = m.bool().cpu().numpy()
            tree_mask = to_device(masks, device)

        def ints(values: Sequence[int]) -> torch.Tensor:
            return to_device(np.asarray(values, dtype=np.int32), device)

        return cls(
            block_tables=to_device(table, device),
            cached_lens=ints(cached_lens),
            query_lens=ints(query_lens),
            query_start=ints(query_start),
            query_positions=to_device(query_positions, device, torch.int32),
            tree_mask=tree_mask,
            block_size=block_size,
            max_query_len=max_q,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields (static inputs of a captured graph)."""
        return {name: getattr(self, name) for name in PLAN_TENSORS if getattr(self, name) is not None}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> PagedAttentionPlan:
        return replace(self, **{k: v for k, v in tensors.items() if k in PLAN_TENSORS})


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``query`` ``[T, H, D]``, caches ``[slots, KVH, D]`` and ``[slots, KVH, DV]`` (new K/V already
    written; values may be of another size, MLA's). Returns ``[T, H, DV]`` in float32 (float64 for
    float64 inputs: the reference a kernel's relative error is taken against); rows that belong to
    no sequence are zero. ``softcap``: logits become ``softcap *
    tanh(s / softcap)`` before the mask; ``sinks`` (``[H]``): a logit per head that joins each
    softmax and gives no value."""
    precise = torch.promote_types(query.dtype, torch.float32)
    num_rows, heads, head_dim = query.shape
    group = heads // k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(num_rows, heads, v_cache.shape[2], dtype=precise, device=query.device)
    bs = plan.block_size
    for b in range(plan.block_tables.shape[0]):
        cached, q_len, start = (int(x[b]) for x in (plan.cached_lens, plan.query_lens, plan.query_start))
        if q_len == 0:
            continue
        ctx = cached + q_len
        keys_idx = torch.arange(ctx, device=query.device)
        slots = plan.block_tables[b].long()[keys_idx // bs] * bs + keys_idx % bs
        k = k_cache[slots].to(precise).repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].to(precise).repeat_interleave(group, dim=1)
        q = query[start : start + q_len].to(precise)  # [Q, H, D]
        new = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        if plan.tree_mask is not None:
            new = plan.tree_mask[b, :q_len, :q_len].bool()
        visible = torch.cat([torch.ones(q_len, cached, dtype=torch.bool, device=query.device), new], dim=1)
        if sliding_window is not None:
            pos = plan.query_positions[start : start + q_len].long()
            visible &= (pos.unsqueeze(1) - keys_idx.unsqueeze(0)) < sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.to(precise).view(heads, 1, 1).expand(heads, q_len, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            weights = torch.nan_to_num(scores.softmax(dim=-1))  # a row with no visible key gives zeros
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", weights, v)
    return out


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    block_q: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """The Triton kernel over the same inputs as :func:`paged_attention_reference`."""
    from ._triton_attention import paged_attention_kernel

    num_rows, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    value_dim = v_cache.shape[2]
    out = torch.zeros(num_rows, heads, value_dim, dtype=torch.float32, device=query.device)
    num_seqs = plan.block_tables.shape[0]
    tree = plan.tree_mask
    grid = (num_seqs, heads, triton_cdiv(plan.max_query_len, block_q))
    paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        *_plan_args(plan),
        _sinks_arg(sinks, plan),
        *_shape_args(plan, scale, sliding_window, head_dim, value_dim, softcap),
        *_stride_args(query, k_cache, v_cache),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        HAS_TREE=tree is not None,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=bool(softcap),
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=_block(head_dim),
        BLOCK_DV=_block(value_dim),
    )
    return out


def split_count(num_seqs: int, kv_heads: int, max_context: int, num_sms: int, block_n: int) -> int:
    """Splits of the context per (sequence, KV head): enough programs to give every SM two, no
    split shorter than four key blocks, a power of two up to 64. It depends only on the launch's
    shapes (a captured graph's bucket), so the grid is static."""
    want = max(1, -(-2 * num_sms // max(1, num_seqs * kv_heads)))
    longest = max(1, max_context // (4 * block_n))
    splits = min(want, longest, 64)
    return 1 << (splits.bit_length() - 1)


def paged_attention_split_kv(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """The split-KV Triton kernel (``kernels/_triton_split_kv.py``: a program per sequence, KV
    head and context split, the group's query heads in one ``tl.dot``; a merge by log-sum-exp) over
    the inputs of :func:`paged_attention_reference`. ``num_splits`` (a power of two): None picks it
    from the shapes and the SM count (:func:`split_count`)."""
    from ._triton_split_kv import merge_splits_kernel, split_kv_attention_kernel

    num_rows, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    num_seqs = plan.block_tables.shape[0]
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 8
        num_splits = split_count(num_seqs, kv_heads, plan.block_tables.shape[1] * plan.block_size, sms, block_n)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    value_dim = v_cache.shape[2]
    parts, maxima, sums = _split_scratch(num_splits, num_rows, heads, value_dim, query.device)
    tree = plan.tree_mask
    split_kv_attention_kernel[(num_seqs, kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        parts,
        maxima,
        sums,
        *_plan_args(plan),
        _sinks_arg(sinks, plan),
        *_shape_args(plan, scale, sliding_window, head_dim, value_dim, softcap),
        num_rows,
        heads,
        *_stride_args(query, k_cache, v_cache),
        GROUP=group,
        NUM_SPLITS=num_splits,
        HAS_TREE=tree is not None,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=bool(softcap),
        IEEE=k_cache.dtype == torch.float32,
        BLOCK_M=max(16, 1 << (plan.max_query_len * group - 1).bit_length()),
        BLOCK_N=block_n,
        BLOCK_D=_block(head_dim),
        BLOCK_DV=_block(value_dim),
    )
    if num_splits == 1:  # the kernel wrote the output itself
        return parts[0]
    out = torch.empty(num_rows, heads, value_dim, dtype=torch.float32, device=query.device)
    merge_splits_kernel[(num_rows, heads)](
        parts,
        maxima,
        sums,
        out,
        _sinks_arg(sinks, plan),
        num_rows,
        heads,
        value_dim,
        NUM_SPLITS=num_splits,
        HAS_SINKS=sinks is not None,
        BLOCK_D=_block(value_dim),
    )
    return out


def _split_scratch(num_splits: int, num_rows: int, heads: int, head_dim: int, device: torch.device):
    """The splits' partial outputs, maxima (from -inf: a split that sees no key weighs 0) and sums.
    With one split the kernel writes the output itself into ``parts``, zeroed so rows of no
    sequence (padding) read 0, as the merge would give them."""
    f32 = {"dtype": torch.float32, "device": device}
    parts = (torch.zeros if num_splits == 1 else torch.empty)(num_splits, num_rows, heads, head_dim, **f32)
    maxima = torch.full((num_splits, num_rows, heads), float("-inf"), **f32)
    return parts, maxima, torch.empty(num_splits, num_rows, heads, **f32)


def _plan_args(plan: PagedAttentionPlan) -> tuple[torch.Tensor, ...]:
    """The plan's tensors in the kernels' order (a stand-in where there is no tree: never read)."""
    tree = plan.tree_mask if plan.tree_mask is not None else plan.query_lens
    return plan.block_tables, plan.cached_lens, plan.query_lens, plan.query_start, tree, plan.query_positions


def _sinks_arg(sinks: torch.Tensor | None, plan: PagedAttentionPlan) -> torch.Tensor:
    """The sink logits as the kernels read them (fp32, contiguous); a stand-in, never read, without."""
    return sinks.detach().float().contiguous() if sinks is not None else plan.query_lens


def _shape_args(
    plan: PagedAttentionPlan, scale: float, window: int | None, head_dim: int, value_dim: int, softcap: float | None
) -> tuple:
    """scale, window, head_dim, value_dim, block_size, max_blocks, mask_q, softcap, in the kernels' order."""
    mask_q = plan.tree_mask.shape[1] if plan.tree_mask is not None else 1
    blocks = plan.block_tables.shape[1]
    return float(scale), int(window or 0), head_dim, value_dim, plan.block_size, blocks, mask_q, float(softcap or 0)


def _block(size: int) -> int:
    """A kernel's tile width for vectors of ``size`` numbers: a power of two, at least 16."""
    return max(16, 1 << (size - 1).bit_length())


def _stride_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
