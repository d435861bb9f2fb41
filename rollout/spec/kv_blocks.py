"""The pieces of a speculative decode step that touch sequences and KV blocks.

A step: the drafter proposes a tree per sequence (:func:`max_draft_depth` bounds it so that
``max_new_tokens`` is never exceeded); :func:`fit_draft` gives the drafts KV room from free
blocks only (a draft never preempts anyone: it is cut to what fits); :func:`pack_verify_batch`
lays out one target forward over every sequence's pending token and draft nodes, with tree
masks; after verification :func:`keep_accepted_kv` moves the accepted path's K/V (if it is not
already in place) to the positions that follow the sequence, and :func:`release_unused_blocks`
hands the blocks that held rejected drafts back to the pool.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from ...draft_contract import DraftShape, DraftTree
from ...kernels.transfers import to_device
from ..model.attention import SequenceSlice
from ..model.kv_cache import BlockAllocator, PagedKVCache, blocks_for, slot_of
from ..request import Sequence


def max_draft_depth(seq: Sequence, shape: DraftShape) -> int:
    """Deepest draft node that can still be emitted: the target always adds one token after the path."""
    remaining = seq.params.max_new_tokens - len(seq.output_ids)
    return max(0, min(shape.depth, remaining - 1))


def fit_draft(seq: Sequence, tree: DraftTree, allocator: BlockAllocator, block_size: int) -> DraftTree:
    """Grow ``seq``'s block table for its pending token plus ``tree`` from free blocks; cut the tree
    to the room there is. The scheduler has already reserved the pending token's slot."""
    if not len(tree):
        return tree
    need = blocks_for(seq.num_cached + 1 + len(tree), block_size)
    missing = need - len(seq.block_table)
    if missing > 0:
        seq.block_table += allocator.allocate(min(missing, allocator.num_free))
    room = len(seq.block_table) * block_size - seq.num_cached - 1
    return tree.truncated(room)


def pack_verify_batch(
    seqs: Seq[Sequence], trees: Seq[DraftTree], pending: torch.Tensor | None = None
) -> tuple[list[SequenceSlice], list[int] | torch.Tensor, list[int]]:
    """Slices, packed tokens and positions of one target forward: per sequence the pending token
    (position ``num_cached``) then its draft nodes (position ``num_cached + depth``). ``pending``:
    the pending tokens still on the device (sampled by a step not read yet; every tree is empty
    then), which are the forward's tokens as they are."""
    slices, tokens, positions = [], [], []
    for seq, tree in zip(seqs, trees):
        c0 = seq.num_cached
        mask = None if tree.is_chain else tree.ancestor_mask()
        parents = (-1, *(p + 1 for p in tree.parents))  # row 0 the pending token, row i + 1 node i
        slices.append(SequenceSlice(seq.block_table, c0, 1 + len(tree), mask, seq.state_slot, parents))
        if pending is None:
            tokens.append(seq.token_at(c0))
            tokens.extend(tree.tokens)
        elif len(tree):
            raise RuntimeError("a step with drafts reads the step in flight first: its pending tokens are on the host")
        positions.append(c0)
        positions.extend(c0 + d for d in tree.depths)
    return slices, tokens if pending is None else pending, positions


def pack_plain_batch(
    seqs: Seq[Sequence], pending: torch.Tensor | None = None
) -> tuple[list[SequenceSlice], list[int] | torch.Tensor, list[int]]:
    """:func:`pack_verify_batch` with every draft empty: one pending token per sequence, at its
    position ``num_cached`` (``pending``: those tokens on the device)."""
    slices = [SequenceSlice(seq.block_table, seq.num_cached, 1, state_slot=seq.state_slot) for seq in seqs]
    positions = [seq.num_cached for seq in seqs]
    tokens = pending if pending is not None else [seq.token_at(seq.num_cached) for seq in seqs]
    return slices, tokens, positions


def keep_accepted_kv(cache: PagedKVCache, seq: Sequence, path: list[int]) -> None:
    """Node ``i`` was written at cache index ``num_cached + 1 + i``; the ``j``-th accepted node
    belongs at ``num_cached + 1 + j``. Move the ones that are elsewhere (never needed for chains)."""
    moves = [(node, j) for j, node in enumerate(path) if node != j]
    if not moves:
        return
    base, bs, table = seq.num_cached + 1, cache.block_size, seq.block_table
    device = cache.layout.device
    slots = [[slot_of(table, base + node, bs) for node, _ in moves], [slot_of(table, base + j, bs) for _, j in moves]]
    src, dst = to_device(np.asarray(slots, dtype=np.int64), device)
    cache.move_slots(src, dst)


def release_unused_blocks(seq: Sequence, allocator: BlockAllocator, block_size: int) -> None:
    """Free the blocks past the ones ``seq``'s tokens occupy (those held rejected drafts)."""
    keep = blocks_for(seq.num_tokens, block_size)
    if len(seq.block_table) > keep:
        allocator.free(seq.block_table[keep:])
        del seq.block_table[keep:]
