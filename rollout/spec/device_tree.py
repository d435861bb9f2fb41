"""Draft trees verified on the device: the pieces a tree step launched before the step in flight
is read needs beyond a chain's (``device_step.py``).

A tree of ``n`` nodes per sequence lives in two ``[B, n]`` tensors, its tokens and its parents
(node indices, ``-1`` for a child of the root), in topological order with siblings in the order
they are tried. The target runs the pending token (row 0) and the nodes (row ``i + 1``, at
position ``cached + depth``, seeing its ancestors: :func:`tree_rows`); :func:`tree_verdicts`
walks every tree at once, level by level, exactly as ``verify.py`` walks one (same acceptance
rule, same residuals, the same uniform per node), so a tree verified here emits what the host's
walk would; :func:`keep_path_kv` moves the accepted nodes' K/V to the positions that follow the
sequence, on the device.
"""

from __future__ import annotations

import torch

from ..model.device_inputs import TreeRows
from ..model.kv_cache import PagedKVCache
from ..sampling import sample_from_probs


def tree_rows(parents: torch.Tensor, depth: int) -> TreeRows:
    """The verification forward's rows for trees with ``parents`` ``[B, n]`` (at most ``depth``
    deep): row 0 the pending token, row ``i + 1`` node ``i`` at offset ``depth(i)``, each row
    seeing the root, its ancestors and itself."""
    batch, n = parents.shape
    up = torch.cat([parents.new_zeros(batch, 1), parents + 1], dim=1)  # [B, n + 1]: each row's parent row
    visible = torch.eye(n + 1, dtype=torch.bool, device=parents.device).expand(batch, -1, -1).clone()
    visible[:, :, 0] = True
    depths = (torch.arange(n + 1, device=parents.device) > 0).long().expand(batch, -1).clone()
    above = up
    for _ in range(depth):  # after step t each row sees its ancestors up to t levels up
        visible.scatter_(2, above.unsqueeze(2), True)
        depths += above > 0  # a node above it: one level deeper
        above = up.gather(1, above)
    return TreeRows(depths, visible)


def tree_verdicts(
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: int,
    topk: int,
    greedy: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Every tree walked at once on the device: the emitted tokens ``[B, depth + 1]`` (the accepted
    nodes' tokens, then the final token, then padding), the accept lengths ``[B]``, the accepted
    nodes ``[B, depth]`` (node indices; past the accept length 0) and the emitted tokens' logprobs.

    ``logprobs``: the processed ``[B * (n + 1), V]`` of the rows of :func:`tree_rows`; ``greedy``
    ``[B]`` bool: rows that follow the argmax (of ``scores`` where given: position-keyed rows),
    emitting it where no child holds it; the others by recursive rejection sampling of one-hot
    drafts with ``uniforms`` ``[B, n + 1]`` float64 (node ``i``'s decides it, the last draws the
    final token): a child ``x`` is accepted with probability ``p(x)``, else ``x`` leaves ``p``
    (renormalised) and the next sibling is tried. ``topk`` bounds the children of a node."""
    batch, n = tokens.shape
    width, device = n + 1, tokens.device
    logprobs = logprobs.view(batch, width, -1)
    best = (logprobs if scores is None else scores.view(batch, width, -1)).argmax(dim=-1)  # [B, n + 1]
    parent_row = parents + 1
    at = torch.arange(batch, device=device)
    tip = torch.zeros(batch, dtype=torch.int64, device=device)  # each walk's row
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.zeros(batch, depth, dtype=torch.int64, device=device)
    accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    final = torch.zeros(batch, dtype=torch.int64, device=device)
    sampled = uniforms is not None  # the caller passes none for an all-greedy batch
    p = logprobs[at, tip].exp() if sampled else None
    left = p  # each sampled row's distribution where its walk stopped: its final token's
    for level in range(depth + 1):
        children = (parent_row == tip.unsqueeze(1)) & alive.unsqueeze(1)  # [B, n], in sibling order
        want = best[at, tip]
        match = children & (tokens == want.unsqueeze(1))
        moved, node = match.any(dim=1), match.int().argmax(dim=1)
        if sampled:
            took, picked, p = _try_children(p, children, tokens, uniforms, topk)
            moved, node = torch.where(greedy, moved, took), torch.where(greedy, node, picked)
        stop = alive & ~moved
        final = torch.where(stop, want, final)
        if sampled:
            left = torch.where(stop.unsqueeze(1), p, left)
        if level < depth:
            path[:, level] = torch.where(moved, node, path[:, level])
        accepted += moved.long()
        tip = torch.where(moved, node + 1, tip)
        if sampled and level < depth:
            p = torch.where(moved.unsqueeze(1), logprobs[at, tip].exp(), p)
        alive = moved
    if sampled:  # greedy rows emit the argmax where they stopped, sampled ones a draw from what was left
        final = torch.where(greedy, final, sample_from_probs(left, uniforms[:, n]))
    columns = torch.arange(depth + 1, device=device)
    padded = torch.cat([tokens.gather(1, path), final.unsqueeze(1)], dim=1)
    taken = columns < accepted.unsqueeze(1)
    emitted = torch.where(taken, padded, final.unsqueeze(1))
    rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)  # the row each emitted token is drawn at
    rows = torch.where(columns <= accepted.unsqueeze(1), rows, torch.zeros_like(rows))
    scored = logprobs.gather(1, rows.unsqueeze(-1).expand(-1, -1, logprobs.shape[-1]))
    return emitted, accepted, path, scored.gather(2, emitted.unsqueeze(-1)).squeeze(-1)


def _try_children(
    p: torch.Tensor, children: torch.Tensor, tokens: torch.Tensor, uniforms: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One level of recursive rejection sampling for every row: its children tried in sibling
    order against ``p`` (one-hot drafts). Returns whether one was accepted, which, and ``p`` as
    the rejections left it (the residual the final token is drawn from where none was)."""
    at = torch.arange(p.shape[0], device=p.device)
    rank = children.long().cumsum(dim=1) - 1
    took = torch.zeros_like(children[:, 0])
    picked = torch.zeros_like(at)
    for s in range(topk):
        this = children & (rank == s)
        tried = this.any(dim=1) & ~took
        node = this.int().argmax(dim=1)
        x = tokens[at, node]
        p_x = p.gather(1, x.unsqueeze(1)).squeeze(1)
        ok = tried & (uniforms[at, node] < p_x)
        picked = torch.where(ok, node, picked)
        took = took | ok
        removed = p.scatter(1, x.unsqueeze(1), 0.0)
        total = removed.sum(dim=1, keepdim=True)
        residual = torch.where(total > 0, removed / total.clamp_min(torch.finfo(p.dtype).tiny), p)
        p = torch.where((tried & ~ok).unsqueeze(1), residual, p)
    return took, picked, p


def keep_path_kv(
    cache: PagedKVCache, tables: torch.Tensor, cached: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor
) -> None:
    """Node ``i`` was written at cache index ``cached + 1 + i``; the ``j``-th accepted node belongs
    at ``cached + 1 + j``. Every move at once on the device (``tables``: the padded block tables
    ``[B, W]``, covering ``cached + 1 + n``); a row past the accept length copies a slot onto itself."""
    bs = cache.block_size
    j = torch.arange(path.shape[1], device=path.device)
    dst = cached.unsqueeze(1) + 1 + j
    src = torch.where(j < accepted.unsqueeze(1), cached.unsqueeze(1) + 1 + path, dst)

    def slots(index: torch.Tensor) -> torch.Tensor:
        return (tables.gather(1, index // bs) * bs + index % bs).reshape(-1)

    cache.move_slots(slots(src), slots(dst))
