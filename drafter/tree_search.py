"""Best-first draft trees (EAGLE-2 style), shared by the model drafters.

Level 1 takes the ``topk`` best children of the root. Each further level expands the ``topk``
best nodes of the previous level (by cumulative log-probability) into their ``topk`` best
children. At the end the ``budget`` best nodes overall form the tree; since a child never
outscores its parent, their ancestors come along. The model call is a callback: given, per
sequence, the nodes to run (the frontier plus its ancestors, as a small :class:`DraftTree`),
it returns the log-probabilities after each frontier node.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..draft_contract import DraftRequest, DraftShape, DraftTree, static_tree_nodes
from ..kernels.transfers import read_back


@dataclass
class Node:
    score: float  # cumulative log-probability
    token: int
    parent: int  # index of the parent node, -1 for a child of the root


@dataclass
class LevelInput:
    """One sequence's share of a level's forward."""

    index: int  # which request
    keep: list[int]  # node ids to run, topological (the frontier and its ancestors)
    sub: DraftTree  # those nodes as a tree (tokens, parents local to ``keep``)
    frontier_rows: list[int]  # rows of ``keep`` whose next-token log-probabilities are wanted


# score_level(inputs) -> log-probabilities [sum of len(frontier_rows), vocab], in input order
ScoreLevel = Callable[[list[LevelInput]], torch.Tensor]


def grow_trees(
    requests: Sequence[DraftRequest],
    root_logprobs: torch.Tensor,
    shape: DraftShape,
    score_level: ScoreLevel,
) -> tuple[list[DraftTree], list[list[Node]]]:
    """Best-first trees for every request; also returns each request's node list (node ids are
    what :class:`LevelInput.keep` refers to)."""
    nodes: list[list[Node]] = [[] for _ in requests]
    frontier: list[list[int]] = [[] for _ in requests]
    root_children = top_children(root_logprobs, shape.topk)
    for i, r in enumerate(requests):
        _add_children(nodes[i], -1, 0.0, root_children[i])
        frontier[i] = _best(nodes[i], range(len(nodes[i])), r.seq.stop_ids, shape.topk)

    for level in range(2, shape.depth + 1):
        active = [i for i, r in enumerate(requests) if frontier[i] and level <= r.max_depth]
        if not active:
            break
        inputs = []
        for i in active:
            keep = with_ancestors(nodes[i], frontier[i])
            local = {n: k for k, n in enumerate(keep)}
            sub = DraftTree([nodes[i][n].token for n in keep], [local.get(nodes[i][n].parent, -1) for n in keep])
            inputs.append(LevelInput(i, keep, sub, [local[n] for n in frontier[i]]))
        children = top_children(score_level(inputs), shape.topk)
        row = 0
        for inp in inputs:
            i = inp.index
            before = len(nodes[i])
            for n in frontier[i]:
                _add_children(nodes[i], n, nodes[i][n].score, children[row])
                row += 1
            frontier[i] = _best(nodes[i], range(before, len(nodes[i])), requests[i].seq.stop_ids, shape.topk)
    return [select(nodes[i], shape.max_nodes) for i in range(len(requests))], nodes


def top_children(logprobs: torch.Tensor, topk: int) -> list[list[tuple[float, int]]]:
    """Per row of ``logprobs`` ``[R, V]``, its ``topk`` best ``(logprob, token)``, best first: the
    whole level's in one read from the device."""
    k = min(topk, logprobs.shape[-1])
    top = torch.topk(logprobs, k, dim=-1)
    values, tokens = read_back(top.values, top.indices)
    return [list(zip(values[r * k : (r + 1) * k], tokens[r * k : (r + 1) * k])) for r in range(logprobs.shape[0])]


def _add_children(nodes: list[Node], parent: int, parent_score: float, children: list[tuple[float, int]]) -> None:
    for lp, tok in children:
        if lp == float("-inf"):
            break
        nodes.append(Node(parent_score + lp, tok, parent))


def _best(nodes: list[Node], candidates, stop_ids, width: int) -> list[int]:
    expandable = [n for n in candidates if nodes[n].token not in stop_ids]
    return heapq.nlargest(width, expandable, key=lambda n: nodes[n].score)


def ancestors(nodes: list[Node], n: int) -> list[int]:
    out = []
    n = nodes[n].parent
    while n >= 0:
        out.append(n)
        n = nodes[n].parent
    return out


def with_ancestors(nodes: list[Node], chosen: list[int]) -> list[int]:
    keep: set[int] = set()
    for n in chosen:
        while n >= 0 and n not in keep:
            keep.add(n)
            n = nodes[n].parent
    return sorted(keep)  # parents were created before children, so this is topological


def select(nodes: list[Node], budget: int) -> DraftTree:
    """The ``budget`` best nodes by score with their ancestors, in topological order with more
    likely siblings first."""
    best = sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, n))[:budget]
    chosen = set(best)
    chosen = {n for n in chosen if all(a in chosen for a in ancestors(nodes, n))}
    order = sorted(chosen, key=lambda n: (len(ancestors(nodes, n)), -nodes[n].score, n))
    local = {n: k for k, n in enumerate(order)}
    return DraftTree([nodes[n].token for n in order], [local.get(nodes[n].parent, -1) for n in order])


# -- static trees, grown on the device -----------------------------------------------------
# LevelPaths(paths, extends) -> log-probabilities [B, topk, V] after each path: paths [B, topk,
# level - 1]; extends [B, topk]: which of the previous call's paths each one extends (None on the
# first call, whose paths are the root's children), for a drafter that carries state along a path
LevelPaths = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def grow_static_trees(
    root_logprobs: torch.Tensor, shape: DraftShape, level_logprobs: LevelPaths
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best-first trees of one shape for every row, on the device, never read: the same search as
    :func:`grow_trees` with every level the same size. Level 1 is the root's ``topk`` best
    children; each further level expands the ``topk`` best nodes of the level before (by
    cumulative log-probability; ``level_logprobs`` runs their paths from the root) into their
    ``topk`` best children; the :func:`static_tree_nodes` best nodes of all levels form the tree
    (ties to the earlier node, so a node's parent always comes along). Returns ``[B, n]`` tokens
    and parents (node indices, -1 for a child of the root), in topological order, siblings best
    first."""
    k, batch = shape.topk, root_logprobs.shape[0]
    scores, tokens = root_logprobs.topk(k, dim=-1)  # level 1, best first
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.full_like(tokens, -1)]
    frontier, paths = torch.arange(k, device=tokens.device).expand(batch, k), tokens.unsqueeze(2)
    extends = None
    for level in range(2, shape.depth + 1):
        child_scores, child_tokens = level_logprobs(paths, extends).topk(k, dim=-1)  # [B, k paths, k children]
        child_scores = (child_scores + scores.unsqueeze(2)).reshape(batch, k * k)
        child_tokens = child_tokens.reshape(batch, k * k)
        all_scores.append(child_scores)
        all_tokens.append(child_tokens)
        all_parents.append(frontier.unsqueeze(2).expand(-1, -1, k).reshape(batch, k * k))
        scores, best = child_scores.topk(k, dim=-1)  # the next frontier
        frontier = k + (level - 2) * k * k + best
        extends = best // k
        ancestors = paths.gather(1, extends.unsqueeze(2).expand(-1, -1, level - 1))
        paths = torch.cat([ancestors, child_tokens.gather(1, best).unsqueeze(2)], dim=2)
    scores, tokens, parents = (torch.cat(x, dim=1) for x in (all_scores, all_tokens, all_parents))
    n = static_tree_nodes(shape)
    chosen = torch.argsort(-scores, dim=1, stable=True)[:, :n].sort(dim=1).values  # topological
    local = torch.full_like(parents, -1)
    local.scatter_(1, chosen, torch.arange(n, device=chosen.device).expand(batch, n))
    parent = parents.gather(1, chosen)
    return tokens.gather(1, chosen), torch.where(parent >= 0, local.gather(1, parent.clamp(min=0)), parent)
