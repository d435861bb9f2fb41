"""Triton source of the fused tree-verification kernel (imported only when first used).

One program verifies one sequence's draft tree: the greedy walk, or recursive rejection sampling
over siblings with residuals, and the final (correction or bonus) token by inverse CDF. The rule
and its arithmetic are those of ``tailspec.rollout.spec.verify`` (the torch reference); the residual
being built lives in a per-sequence scratch row. See ``kernels/tree_verify.py`` for the layout.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_row(src_ptr, dst_ptr, V, BLOCK_V: tl.constexpr):
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < V, other=0.0), mask=offs < V)
    tl.debug_barrier()


@triton.jit
def _minus_draft(scratch_ptr, q_ptr, offs, inside, token, use_q):
    """max(0, p - q) on one block; q is one-hot(token) when use_q == 0."""
    p = tl.load(scratch_ptr + offs, mask=inside, other=0.0)
    if use_q != 0:
        r = tl.maximum(p - tl.load(q_ptr + offs, mask=inside, other=0.0), 0.0)
    else:
        r = tl.where(offs == token, 0.0, p)
    return r


@triton.jit
def _residual(scratch_ptr, q_ptr, token, use_q, V, BLOCK_V: tl.constexpr):
    """scratch <- normalize(max(0, scratch - q)); left as is when nothing remains (p == q up to
    rounding), like ``rollout.verify.residual``."""
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        total += tl.sum(_minus_draft(scratch_ptr, q_ptr, offs, offs < V, token, use_q), axis=0)
    if total > 0:
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            r = _minus_draft(scratch_ptr, q_ptr, offs, offs < V, token, use_q)
            tl.store(scratch_ptr + offs, r / total, mask=offs < V)
    tl.debug_barrier()


@triton.jit
def _sample_row(p_ptr, u, V, BLOCK_V: tl.constexpr):
    """Inverse-CDF draw from the (unnormalised) row, as ``rollout.sampling.sample_from_probs``."""
    carry = tl.zeros((), dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(p_ptr + offs, mask=offs < V, other=0.0).to(tl.float64)
        carry += tl.sum(p, axis=0)
    total = carry
    threshold = u * total
    count = tl.zeros((), dtype=tl.int32)
    below_total = tl.zeros((), dtype=tl.int32)
    carry = tl.zeros((), dtype=tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inside = offs < V
        p = tl.load(p_ptr + offs, mask=inside, other=0.0).to(tl.float64)
        cdf = carry + tl.cumsum(p, axis=0)
        count += tl.sum(((cdf <= threshold) & inside).to(tl.int32), axis=0)
        below_total += tl.sum(((cdf < total) & inside).to(tl.int32), axis=0)
        carry += tl.sum(p, axis=0)
    return tl.minimum(count, below_total)


@triton.jit
def verify_trees_kernel(
    target_probs_ptr,  # [R, V] f32 processed target distribution per scored row
    draft_probs_ptr,  # [N, V] f32 draft distribution per node (rows of one-hot drafts unused)
    argmax_ptr,  # [R] i32 target argmax per row (greedy sequences)
    uniforms_ptr,  # [R] f64: row_start + c decides node c, row_start + n draws the final token
    row_start_ptr, node_start_ptr, num_nodes_ptr,  # [B] i32: each sequence's root row, first node, nodes
    greedy_ptr, has_q_ptr,  # [B] i32: greedy; 0 = deterministic drafts (one-hot q)
    first_child_ptr, next_sibling_ptr,  # [R], [N] i32 local node indices, -1 = none
    tokens_ptr, scratch_ptr,  # [N] i32; [B, V] f32
    path_ptr, path_len_ptr, final_ptr,  # out: [B, W] i32 accepted local node indices; [B] i32; [B] i32
    V, W, BLOCK_V: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    row0 = tl.load(row_start_ptr + b)
    node0 = tl.load(node_start_ptr + b)
    n = tl.load(num_nodes_ptr + b)
    greedy = tl.load(greedy_ptr + b)
    has_q = tl.load(has_q_ptr + b)
    scratch = scratch_ptr + b.to(tl.int64) * V

    row, depth = 0, 0  # the row whose children are tried next, and the accepted path's length
    active, final = 1, 0
    while active != 0:
        child = tl.load(first_child_ptr + row0 + row)
        moved = 0
        if greedy != 0:
            want = tl.load(argmax_ptr + row0 + row)
            while (child >= 0) & (moved == 0):
                if tl.load(tokens_ptr + node0 + child) == want:
                    moved = 1
                else:
                    child = tl.load(next_sibling_ptr + node0 + child)
            final = want
        else:
            _load_row(target_probs_ptr + (row0 + row).to(tl.int64) * V, scratch, V, BLOCK_V)
            while (child >= 0) & (moved == 0):
                node = node0 + child
                token = tl.load(tokens_ptr + node)
                q_row = draft_probs_ptr + node.to(tl.int64) * V
                q_token = 1.0
                if has_q != 0:
                    q_token = tl.load(q_row + token)
                u = tl.load(uniforms_ptr + row0 + child)
                p_token = tl.load(scratch + token)
                if (q_token > 0) & (u * q_token < p_token):
                    moved = 1
                else:
                    _residual(scratch, q_row, token, has_q, V, BLOCK_V)
                    child = tl.load(next_sibling_ptr + node)
            if moved == 0:
                final = _sample_row(scratch, tl.load(uniforms_ptr + row0 + n), V, BLOCK_V)
        if moved != 0:
            tl.store(path_ptr + b * W + depth, child)
            depth += 1
            row = child + 1
        else:
            active = 0
    tl.store(path_len_ptr + b, depth)
    tl.store(final_ptr + b, final)


__all__ = ["verify_trees_kernel"]
