"""Fused verification of a batch of draft trees: the layout the kernel reads, and its launcher.

Sequence ``b``'s tree of ``n`` nodes owns ``n + 1`` consecutive scored rows starting at
``row_start[b]`` (row 0 = the root, row ``i + 1`` = node ``i``), exactly as the engine packs the
verification forward. Its nodes are stored from ``node_start[b]``; ``first_child`` (per row) and
``next_sibling`` (per node) encode the tree in sibling order. ``uniforms`` is aligned with the
rows: ``uniforms[row_start + c]`` decides node ``c`` and ``uniforms[row_start + n]`` draws the
final token, so the kernel and the torch reference (``tailspec.rollout.spec.verify``) consume the
same random draws and agree exactly on every decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .transfers import to_device


class TreeLike(Protocol):
    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None


@dataclass
class PackedTrees:
    row_start: torch.Tensor  # [B] int32
    node_start: torch.Tensor  # [B] int32
    num_nodes: torch.Tensor  # [B] int32
    first_child: torch.Tensor  # [R] int32
    next_sibling: torch.Tensor  # [N] int32
    tokens: torch.Tensor  # [N] int32
    has_q: torch.Tensor  # [B] int32
    draft_probs: torch.Tensor  # [N, V] float32 ([1, V] zeros when no tree has draft probabilities)
    max_depth: int

    @property
    def num_rows(self) -> int:
        return int(self.first_child.shape[0])


def pack_trees(trees: Sequence[TreeLike], vocab: int, device: torch.device) -> PackedTrees:
    row_start, node_start, num_nodes, has_q = [], [], [], []
    first_child: list[int] = []
    next_sibling: list[int] = []
    tokens: list[int] = []
    q_rows: list[torch.Tensor] = []
    any_q = any(t.draft_probs is not None for t in trees)
    max_depth = 0
    for tree in trees:
        n = len(tree.tokens)
        row_start.append(len(first_child))
        node_start.append(len(tokens))
        num_nodes.append(n)
        has_q.append(int(tree.draft_probs is not None))
        heads = [-1] * (n + 1)
        siblings = [-1] * n
        depth = [0] * n
        for i in range(n - 1, -1, -1):  # reverse, so each row's list ends up in sibling order
            parent_row = tree.parents[i] + 1
            siblings[i] = heads[parent_row]
            heads[parent_row] = i
        for i, p in enumerate(tree.parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        max_depth = max([max_depth, *depth])
        first_child += heads
        next_sibling += siblings
        tokens += list(tree.tokens)
        if any_q and n:
            q = tree.draft_probs if tree.draft_probs is not None else torch.zeros(n, vocab, device=device)
            q_rows.append(to_device(q, device, torch.float32))

    # the seven index arrays travel in one queued copy (each alone would wait for the device)
    fields = [row_start, node_start, num_nodes, first_child, next_sibling or [-1], tokens or [0], has_q]
    packed = to_device(np.asarray([v for f in fields for v in f], dtype=np.int32), device)
    row_start_t, node_start_t, num_nodes_t, first_child_t, next_sibling_t, tokens_t, has_q_t = packed.split(
        [len(f) for f in fields]
    )
    if q_rows:
        draft_probs = torch.cat(q_rows).contiguous()
    else:
        draft_probs = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    return PackedTrees(
        row_start=row_start_t,
        node_start=node_start_t,
        num_nodes=num_nodes_t,
        first_child=first_child_t,
        next_sibling=next_sibling_t,
        tokens=tokens_t,
        has_q=has_q_t,
        draft_probs=draft_probs,
        max_depth=max_depth,
    )


def verify_trees_triton(
    packed: PackedTrees,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the kernel. Returns ``(path [B, W], path_len [B], final_token [B])`` as int32; row ``b``
    of ``path`` holds ``path_len[b]`` accepted local node indices, root to leaf."""
    from ._triton_verify import verify_trees_kernel

    num_seqs = int(packed.row_start.shape[0])
    rows, vocab = target_probs.shape
    if rows != packed.num_rows:
        raise ValueError(f"target_probs has {rows} rows, the packed trees score {packed.num_rows}")
    device = target_probs.device
    width = max(1, packed.max_depth)
    path = torch.full((num_seqs, width), -1, dtype=torch.int32, device=device)
    path_len = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    final = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    scratch = torch.empty(num_seqs, vocab, dtype=torch.float32, device=device)
    block = min(block_v, 1 << max(4, (vocab - 1).bit_length()))
    verify_trees_kernel[(num_seqs,)](
        target_probs.float().contiguous(),
        packed.draft_probs,
        target_argmax.to(torch.int32).contiguous(),
        uniforms.to(torch.float64).contiguous(),
        packed.row_start,
        packed.node_start,
        packed.num_nodes,
        greedy.to(torch.int32).contiguous(),
        packed.has_q,
        packed.first_child,
        packed.next_sibling,
        packed.tokens,
        scratch,
        path,
        path_len,
        final,
        vocab,
        width,
        BLOCK_V=block,
        enable_fp_fusion=False,  # no fused multiply-adds: the same rounding as the torch reference
    )
    return path, path_len, final
