"""Attention metadata of a captured forward's fixed shape ``[batch, tokens, context]``
(``rollout/model/graph_pool.py``): real sequences' rows in place, padding rows writing to a
scratch slot. Built with whole-array numpy operations: it runs on the host before every replay."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...kernels.paged_attention import PagedAttentionPlan
from .attention import AttentionMetadata, SequenceSlice, attention_backend
from .kv_cache import PagedKVCache


def padded_rows(seqs: Sequence[SequenceSlice], batch: int, tokens: int) -> np.ndarray:
    """``[batch, tokens]`` bool: which rows of a padded forward hold a real new token (sequence
    ``i``'s new tokens are rows ``i * tokens + r``, in the packed order)."""
    new = np.fromiter((s.num_new for s in seqs), np.int64, len(seqs))
    valid = np.zeros((batch, tokens), dtype=bool)
    valid[: len(seqs)] = np.arange(tokens) < new[:, None]
    return valid


def build_padded_metadata(
    cache: PagedKVCache,
    seqs: Sequence[SequenceSlice],
    positions: Sequence[int],
    batch: int,
    tokens: int,
    context: int,
    scratch_slot: int,
    kernels: str | None = None,
    valid: np.ndarray | None = None,
    device: torch.device | str | None = None,
) -> AttentionMetadata:
    """Metadata of fixed shape ``[batch, tokens, context]`` for a captured forward (``valid``: the
    :func:`padded_rows` of ``seqs``, when the caller has them), its tensors on ``device`` (the
    cache's by default; the graph pool takes them on the host and copies them over in one go).

    Sequence ``i``'s new tokens are rows ``i * tokens + r``. Padding rows (beyond a sequence's
    new tokens, or whole padding sequences) write their K/V to ``scratch_slot`` and attend to one
    key, so they never touch a real sequence's cache and keep the softmax finite. Built with whole-
    array numpy operations (a loop over sequences only for tree masks): this runs on the host
    before every captured replay, so its cost per sequence bounds large batches' step time.
    """
    device = cache.layout.device if device is None else torch.device(device)
    bs, n = cache.block_size, len(seqs)
    use_plan = attention_backend(cache, kernels, tokens) == "triton"
    cached = np.fromiter((s.num_cached for s in seqs), np.int64, n)
    new = np.fromiter((s.num_new for s in seqs), np.int64, n)
    blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
    ends = cached + new
    _check_fits(new, ends, blocks, bs, tokens, context)
    valid = padded_rows(seqs, batch, tokens) if valid is None else valid
    table = _padded_block_tables(seqs, -(-context // bs), scratch_slot // bs)  # [n, width]
    rows = np.arange(tokens)
    new_keys = cached[:, None] + rows  # [n, tokens]: cache index of each row's token
    new_blocks = np.take_along_axis(table, np.minimum(new_keys // bs, table.shape[1] - 1), axis=1)
    slot_mapping = np.full((batch, tokens), scratch_slot, dtype=np.int64)
    slot_mapping[:n] = np.where(valid[:n], new_blocks * bs + new_keys % bs, scratch_slot)
    query_positions = np.zeros((batch, tokens), dtype=np.int64)
    query_positions[valid] = np.asarray(positions, dtype=np.int64)
    if use_plan:  # the kernel reads block tables, not gathered slots
        gather, mask = np.zeros((batch, 0), dtype=np.int64), np.zeros((batch, tokens, 0), dtype=bool)
    else:
        gather, mask = _gathered(seqs, table, ends, new_keys, valid, (batch, tokens, context), scratch_slot, bs)
    query_positions_t = torch.from_numpy(query_positions)
    plan = None
    if use_plan:
        plan = _padded_plan(seqs, table, cached, new, tokens, scratch_slot, query_positions_t, bs, device)
    return AttentionMetadata(
        cache=cache,
        slot_mapping=torch.from_numpy(slot_mapping.reshape(-1)).to(device),
        gather_slots=torch.from_numpy(gather).to(device),
        mask=torch.from_numpy(mask).unsqueeze(1).to(device),
        query_positions=query_positions_t.to(device),
        num_seqs=batch,
        max_new=tokens,
        query_index=None,
        valid_queries=None,
        plan=plan,
    )


def _check_fits(new: np.ndarray, ends: np.ndarray, blocks: np.ndarray, bs: int, tokens: int, context: int) -> None:
    """Every sequence within the bucket and its own block table, else a ``ValueError`` naming the first."""
    bad = np.flatnonzero((ends > context) | (new > tokens) | (blocks * bs < ends))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"sequence {i} ({new[i]} new, {ends[i]} in context, {blocks[i]} blocks of {bs}) exceeds "
            f"the bucket ({tokens} new, {context} in context) or its block table"
        )


def _gathered(
    seqs: Sequence[SequenceSlice],
    table: np.ndarray,
    ends: np.ndarray,
    new_keys: np.ndarray,
    valid: np.ndarray,
    shape: tuple[int, int, int],
    scratch_slot: int,
    bs: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The gathering path's ``[batch, context]`` slots (the scratch slot past a sequence's context)
    and ``[batch, tokens, context]`` mask: a row sees the cached prefix and the new tokens up to
    itself, or its draft tree's ancestors; padding rows see key 0 alone."""
    batch, tokens, context = shape
    n, keys = len(seqs), np.arange(context)
    gather = np.full((batch, context), scratch_slot, dtype=np.int64)
    spread = (table[:, :, None] * bs + np.arange(bs)).reshape(n, -1)[:, :context]  # every key's slot
    spread[keys >= ends[:, None]] = scratch_slot
    gather[:n] = spread
    mask = np.zeros((batch, tokens, context), dtype=bool)
    mask[:n] = valid[:n, :, None] & (keys < (new_keys + 1)[:, :, None])
    for i, s in enumerate(seqs):
        if s.new_token_mask is not None:  # a draft tree: its ancestor mask among the new tokens
            c0, q = s.num_cached, s.num_new
            mask[i, :q, c0 : c0 + q] = s.new_token_mask.bool().cpu().numpy()
    mask[:, :, 0] = True  # padding rows; for real rows key 0 is visible anyway (prefix or first new token)
    return gather, mask


def _padded_block_tables(seqs: Sequence[SequenceSlice], width: int, scratch_block: int) -> np.ndarray:
    """``[len(seqs), width]``: each sequence's first ``width`` blocks, then the scratch block."""
    table = np.full((len(seqs), width), scratch_block, dtype=np.int64)
    for i, s in enumerate(seqs):
        head = s.block_table[:width]
        table[i, : len(head)] = head
    return table


def _padded_plan(
    seqs: Sequence[SequenceSlice],
    table: np.ndarray,
    cached: np.ndarray,
    new: np.ndarray,
    tokens: int,
    scratch_slot: int,
    query_positions: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> PagedAttentionPlan:
    """The kernel's plan for a captured bucket (``query_positions``: ``[batch, tokens]``): padding
    sequences read only the scratch block."""
    batch, width = query_positions.shape[0], table.shape[1]
    pad = batch - len(seqs)
    nothing = np.zeros(pad, dtype=np.int64)
    return PagedAttentionPlan.build(
        np.concatenate([table, np.full((pad, width), scratch_slot // block_size, dtype=np.int64)]),
        np.concatenate([cached, nothing]),
        np.concatenate([new, nothing]),
        np.arange(batch) * tokens,
        query_positions.reshape(-1),
        [s.new_token_mask for s in seqs] + [None] * pad,
        block_size,
        device,
        mask_size=tokens,
    )
