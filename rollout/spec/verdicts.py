"""Every sequence's draft verified at once, as tensors: chains (:func:`greedy_chain_verdicts`,
:func:`sampled_chain_verdicts`) and one-hot trees of one size (:func:`tree_verdicts`), with the
acceptance rule, residuals and per-node uniforms of ``verify.py``'s walk of one tree (its
reference), so a batch verified here emits what the walk would. The device step verifies every
step so (``device_step.py``), and a step drafted from the host's text the sampled drafts that share a shape
(``verify.verify_batch``): a few tensor operations per batch instead of dozens per sequence.
"""

from __future__ import annotations

import torch

from ..sampling import sample_from_probs


def chain_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a chain's final token is drawn from after its draft (drawn from ``q``) was rejected at
    a row whose target distribution is ``p``: ``max(0, p - q)``, every row at once (unnormalised:
    :func:`~tailspec.rollout.sampling.sample_from_probs` scales by the total)."""
    return (p - q).clamp_min(0.0)


def greedy_chain_verdicts(
    logprobs: torch.Tensor, drafts: torch.Tensor, scores: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """On the device, for chains whose rows all take an argmax: the emitted tokens ``[B, k + 1]``
    (row ``j``'s argmax: an accepted draft is the argmax of the row before it, and row ``L``'s is
    the correction or the bonus token), each chain's accept length ``L`` ``[B]`` (its drafts equal
    to the argmax before them, up to the first that is not) and the tokens' logprobs ``[B, k + 1]``.
    ``logprobs``: the processed ``[B * (k + 1), V]``; ``scores``: what the argmax is of, where not
    the logprobs (position-keyed rows' perturbed scores, which verify as greedy ones)."""
    batch, depth = drafts.shape
    logprobs = logprobs.view(batch, depth + 1, -1)
    best = (logprobs if scores is None else scores.view(batch, depth + 1, -1)).argmax(dim=-1)
    accepted = (drafts == best[:, :depth]).long().cumprod(dim=1).sum(dim=1)
    return best, accepted, logprobs.gather(2, best.unsqueeze(-1)).squeeze(-1)


def sampled_chain_verdicts(
    logprobs: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor,
    uniforms: torch.Tensor,
    greedy: torch.Tensor,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`greedy_chain_verdicts` for a batch with sampled rows, on the device: the drafts and the
    distributions ``q`` ``[B, k, V]`` they were drawn from, ``uniforms`` ``[B, k + 1]`` (float64),
    ``greedy`` ``[B]`` bool (rows that take the argmax of their ``scores``).

    Draft ``j`` (token ``x`` from ``q_j``) is accepted with probability ``min(1, p_j(x) / q_j(x))``
    (``u_j q_j(x) < p_j(x)``); after the first rejection, at ``L``, the final token is drawn from
    ``normalize(max(0, p_L - q_L))`` with ``u_k``, or from ``p_k`` when every draft was accepted:
    speculative sampling's chain case (``rollout/spec/verify.py`` proves it exact; this is the same
    walk for a chain, every row at once). Greedy rows accept the argmax and emit it, as greedy chains."""
    batch, depth = drafts.shape
    logprobs = logprobs.view(batch, depth + 1, -1)
    p = logprobs.exp()
    x = drafts.unsqueeze(-1)
    p_x, q_x = p[:, :depth].gather(2, x).squeeze(-1), q.to(p).gather(2, x).squeeze(-1)
    sampled_ok = (q_x > 0) & (uniforms[:, :depth] * q_x < p_x)
    best = (logprobs if scores is None else scores.view(batch, depth + 1, -1)).argmax(dim=-1)
    ok = torch.where(greedy.unsqueeze(1), drafts == best[:, :depth], sampled_ok)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    at = accepted.view(batch, 1, 1).expand(-1, 1, p.shape[-1])
    p_at = p.gather(1, at).squeeze(1)
    q_at = q.to(p).gather(1, at.clamp(max=depth - 1)).squeeze(1)
    residual = chain_residual(p_at, q_at)
    rejected = (accepted < depth).unsqueeze(1) & (residual.sum(dim=-1, keepdim=True) > 0)
    final = sample_from_probs(torch.where(rejected, residual, p_at), uniforms[:, depth])
    final = torch.where(greedy, best.gather(1, accepted.unsqueeze(1)).squeeze(1), final)
    columns = torch.arange(depth + 1, device=drafts.device)
    padded = torch.cat([drafts, drafts[:, :1]], dim=1)
    emitted = torch.where(columns < accepted.unsqueeze(1), padded, final.unsqueeze(1))
    return emitted, accepted, logprobs.gather(2, emitted.unsqueeze(-1)).squeeze(-1)


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
    emitted, emitted_logprobs = _along_path(logprobs, tokens, path, accepted, final)
    return emitted, accepted, path, emitted_logprobs


def _along_path(logprobs, tokens, path, accepted, final) -> tuple[torch.Tensor, torch.Tensor]:
    """The emitted tokens ``[B, depth + 1]`` (the accepted nodes' tokens, then ``final``, then
    ``final`` as padding) and each one's logprob at the row it was drawn at."""
    columns = torch.arange(path.shape[1] + 1, device=path.device)
    padded = torch.cat([tokens.gather(1, path), final.unsqueeze(1)], dim=1)
    emitted = torch.where(columns < accepted.unsqueeze(1), padded, final.unsqueeze(1))
    rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1)  # the row each emitted token is drawn at
    rows = torch.where(columns <= accepted.unsqueeze(1), rows, torch.zeros_like(rows))
    scored = logprobs.gather(1, rows.unsqueeze(-1).expand(-1, -1, logprobs.shape[-1]))
    return emitted, scored.gather(2, emitted.unsqueeze(-1)).squeeze(-1)


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
