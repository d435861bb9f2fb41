"""Lossless verification of a draft tree against the target's processed distribution.

Each sequence's tree is walked from the root. At a node whose target distribution is ``p``,
its children are tried in sibling order; child ``c`` (token ``x``, drawn from ``q_c``) is
accepted with probability ``min(1, p(x) / q_c(x))``; on rejection ``p`` becomes the residual
``normalize(max(0, p - q_c))`` and the next sibling is tried (recursive rejection sampling,
multi-draft). When a child is accepted the walk moves into it; when all children are rejected,
or the node is a leaf, one final token is drawn from the current ``p`` (the correction, or the
bonus token at a leaf). Each step is a standard speculative-sampling step, so by induction every
emitted token is distributed exactly as the target's processed distribution, whatever the
drafts. Deterministic drafts use ``q_c = one-hot(x)``: accept with probability ``p(x)``, and the
residual is ``p`` with ``x`` removed.

Greedy is the temperature-to-zero case: follow the child whose token is the target's argmax,
and emit the argmax where no child matches, which reproduces argmax decoding token for token.

:func:`verify_each` walks each tree on its own, the reference; :func:`verify_batch` verifies the
sampled drafts of a batch that share a shape together (``verdicts.py``: the same rule and the
same uniforms, a few tensor operations per batch instead of dozens per sequence).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from ...draft_contract import DraftTree
from ...kernels.dispatch import resolve_backend
from ...kernels.transfers import read_back, to_device
from ..sampling import sample_from_probs
from .verdicts import sampled_chain_verdicts, tree_verdicts


@dataclass
class Verdict:
    """The outcome for one sequence: accepted nodes, then one more token from the target."""

    path: list[int]  # accepted node indices, root to leaf
    final_token: int  # correction (after a rejection) or bonus (at a leaf)
    # the emitted tokens' logprobs, when the verification read them with the verdict
    logprobs: list[float] | None = None

    def emitted(self, tree: DraftTree) -> list[tuple[int, int]]:
        """``(token, row)`` for every emitted token; ``row`` is where its target distribution is
        (0 = the root, ``i + 1`` = node ``i``)."""
        rows = [0] + [c + 1 for c in self.path]
        tokens = [tree.tokens[c] for c in self.path] + [self.final_token]
        return list(zip(tokens, rows))


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """``normalize(max(0, p - q))`` after ``token`` drawn from ``q`` was rejected (``q=None``: one-hot)."""
    if q is None:
        out = p.clone()
        out[token] = 0.0
    else:
        out = (p - q).clamp_min(0.0)
    total = out.sum()
    if total <= 0:  # p == q up to rounding: rejection had probability ~0; p itself is the answer
        return p
    return out / total


def verify_greedy(tree: DraftTree, target_argmax: list[int]) -> Verdict:
    """``target_argmax[r]`` is the target's argmax at row ``r`` (0 = root, ``i + 1`` = node ``i``)."""
    path: list[int] = []
    row = 0
    while True:
        want = target_argmax[row]
        match = next((c for c in tree.children[row] if tree.tokens[c] == want), None)
        if match is None:
            return Verdict(path, want)
        path.append(match)
        row = match + 1


def verify_sampled(
    tree: DraftTree, target_probs: Callable[[int], torch.Tensor], uniforms: Sequence[float] | torch.Tensor
) -> Verdict:
    """Recursive rejection sampling. ``target_probs(row)`` returns the processed target
    distribution at ``row``; ``uniforms`` holds ``len(tree) + 1`` draws from U[0, 1): entry ``c``
    decides node ``c`` (used only if the walk reaches it) and the last one draws the final token.
    Pre-drawn per node, so the Triton kernel consumes exactly the same randomness."""
    path: list[int] = []
    row = 0
    p = target_probs(0)
    while True:
        for c in tree.children[row]:
            token = tree.tokens[c]
            q = tree.draft_probs[c].to(p) if tree.draft_probs is not None else None
            q_token = 1.0 if q is None else float(q[token])
            if q_token > 0 and float(uniforms[c]) * q_token < float(p[token]):
                path.append(c)
                row = c + 1
                p = target_probs(row)
                break
            p = residual(p, q, token)
        else:
            u = torch.tensor(float(uniforms[len(tree)]), dtype=torch.float64, device=p.device)
            final = int(sample_from_probs(p, u))
            return Verdict(path, final)


def verify_batch(
    trees: Sequence[DraftTree],
    logprobs: torch.Tensor,
    greedy: Sequence[bool],
    uniforms: torch.Tensor,
    backend: str | None = None,
    argmax: Sequence[int] | None = None,
    emitted_from: torch.Tensor | None = None,
) -> list[Verdict]:
    """Verify every sequence's tree from one verification forward.

    ``logprobs`` ``[R, V]`` are the processed target log-probabilities of the packed rows (tree
    ``b`` owns ``len(trees[b]) + 1`` consecutive rows, root first); ``uniforms`` ``[R]`` float64
    is aligned with the rows (see :func:`verify_sampled`; greedy sequences ignore theirs);
    ``argmax``: each row's argmax when the caller has read it already. ``emitted_from``: a
    ``[R, V]`` distribution (the processed logprobs, where ``logprobs`` are perturbed scores) whose
    values at the emitted tokens the fused kernel's verdicts carry, read with them.
    ``backend`` picks the fused Triton kernel or torch (see ``tailspec.kernels``): there, sampled
    trees that share a shape are verified together (``verdicts.py``), the others walked one by
    one (:func:`verify_each`, the reference both are held to). An
    all-greedy batch walks its trees on the host whatever the backend: it needs only the rows'
    argmax, one read, where the kernel's inputs and outputs would cost several transfers.
    """
    if not all(greedy) and resolve_backend(logprobs.device, backend, kernel="verify") == "triton":
        return _verify_batch_triton(trees, logprobs, greedy, uniforms, emitted_from)
    verdicts: list[Verdict | None] = [None] * len(trees)
    starts = _row_starts(trees)
    if not all(greedy):
        _verify_shared_shapes(trees, starts, logprobs, greedy, uniforms, verdicts)
    return verify_each(trees, logprobs, greedy, uniforms, argmax, verdicts, starts)


def _row_starts(trees: Sequence[DraftTree]) -> list[int]:
    """The first packed row of each tree (tree ``b`` owns ``len(trees[b]) + 1`` rows)."""
    return list(accumulate((len(t) + 1 for t in trees), initial=0))


def verify_each(
    trees: Sequence[DraftTree],
    logprobs: torch.Tensor,
    greedy: Sequence[bool],
    uniforms: torch.Tensor,
    argmax: Sequence[int] | None = None,
    verdicts: list[Verdict | None] | None = None,
    starts: list[int] | None = None,
) -> list[Verdict]:
    """:func:`verify_batch`'s reference: every tree walked on its own (:func:`verify_greedy`,
    :func:`verify_sampled`), except those ``verdicts`` holds already; ``starts``: each tree's first
    row, where the caller has them."""
    verdicts = verdicts if verdicts is not None else [None] * len(trees)
    todo = [b for b, v in enumerate(verdicts) if v is None]
    sampled = any(not greedy[b] for b in todo)
    probs = logprobs.exp() if sampled else None
    if argmax is None:
        argmax = logprobs.argmax(dim=-1).tolist() if any(greedy[b] for b in todo) else []
    starts = starts if starts is not None else _row_starts(trees)
    for b in todo:
        tree, offset, n = trees[b], starts[b], len(trees[b]) + 1
        if greedy[b]:
            verdicts[b] = verify_greedy(tree, list(argmax[offset : offset + n]))
        else:
            rows = probs[offset : offset + n]
            verdicts[b] = verify_sampled(tree, lambda r, rows=rows: rows[r], uniforms[offset : offset + n].tolist())
    return verdicts


def _verify_shared_shapes(
    trees: Sequence[DraftTree],
    starts: list[int],
    logprobs: torch.Tensor,
    greedy: Sequence[bool],
    uniforms: torch.Tensor,
    verdicts: list[Verdict | None],
) -> None:
    """Sampled trees that share a shape, verified together (``verdicts.py``: the same rule and
    uniforms as :func:`verify_sampled`): empty drafts, chains of one length (drafted with
    distributions or deterministically), deterministic trees of one size. Every group's accepted
    nodes, final token and emitted tokens' logprobs are read in one transfer. Fills their entries
    of ``verdicts``."""
    groups: dict[tuple, list[int]] = {}
    for b, tree in enumerate(trees):
        with_probs = tree.draft_probs is not None
        if greedy[b]:
            continue
        if tree.is_chain:
            groups.setdefault(("chain", with_probs, len(tree)), []).append(b)
        elif not with_probs:
            groups.setdefault(("tree", False, len(tree)), []).append(b)
    outcomes = [_group_outcome(trees, starts, logprobs, uniforms, key, members) for key, members in groups.items()]
    read = iter(read_back(*(t for outcome in outcomes for t in outcome)))  # one wait for the device
    for members in groups.values():
        paths, accepted, finals, emitted_lps = next(read), next(read), next(read), next(read)
        depth, width = len(paths) // len(members), len(emitted_lps) // len(members)
        for i, (b, a, final) in enumerate(zip(members, accepted, finals)):
            lps = emitted_lps[i * width : i * width + a + 1]
            verdicts[b] = Verdict(paths[i * depth : i * depth + a], final, lps)


def _group_outcome(
    trees: Sequence[DraftTree],
    starts: list[int],
    logprobs: torch.Tensor,
    uniforms: torch.Tensor,
    key: tuple,
    members: list[int],
) -> tuple[torch.Tensor, ...]:
    """One shape group's verdicts on the device: accepted nodes ``[m, n]`` (padded), accept lengths,
    final tokens and the emitted tokens' logprobs ``[m, n + 1]``."""
    kind, with_probs, n = key
    device = logprobs.device
    rows = torch.tensor([starts[b] + r for b in members for r in range(n + 1)], device=device)
    scored, drawn = logprobs.index_select(0, rows), uniforms.to(device).index_select(0, rows).view(-1, n + 1)
    no_greedy = torch.zeros(len(members), dtype=torch.bool, device=device)
    if n == 0:  # nothing drafted: the final token drawn from the root's distribution
        final = sample_from_probs(scored.exp(), drawn[:, 0])
        empty = torch.zeros(len(members), 0, dtype=torch.int64, device=device)
        return empty, torch.zeros_like(final), final, scored.gather(1, final.unsqueeze(1))
    tokens = torch.tensor([trees[b].tokens for b in members], device=device)
    if kind == "chain":
        q = (
            torch.stack([trees[b].draft_probs for b in members]).to(device)
            if with_probs
            else torch.nn.functional.one_hot(tokens, logprobs.shape[-1])
        )
        emitted, accepted, emitted_lps = sampled_chain_verdicts(scored, tokens, q, drawn, no_greedy)
        path = torch.arange(n, device=device).expand(len(members), -1)
    else:
        parents = torch.tensor([trees[b].parents for b in members], device=device)
        depth = max(max(trees[b].depths) for b in members)
        topk = max(max(len(c) for c in trees[b].children) for b in members)
        emitted, accepted, path, emitted_lps = tree_verdicts(scored, tokens, parents, depth, topk, no_greedy, drawn)
    final = emitted.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return path, accepted, final, emitted_lps


def _verify_batch_triton(
    trees: Sequence[DraftTree],
    logprobs: torch.Tensor,
    greedy: Sequence[bool],
    uniforms: torch.Tensor,
    emitted_from: torch.Tensor | None = None,
) -> list[Verdict]:
    from ...kernels.tree_verify import pack_trees, verify_trees_triton

    device = logprobs.device
    packed = pack_trees(trees, logprobs.shape[-1], device)
    path, path_len, final = verify_trees_triton(
        packed,
        logprobs.exp(),
        logprobs.argmax(dim=-1),
        to_device(np.asarray(greedy, dtype=np.int32), device),
        to_device(uniforms, device, torch.float64),
    )
    extra = emitted_logprobs(trees, emitted_from, path, path_len, final) if emitted_from is not None else ()
    flat_paths, lens, finals, *read = read_back(path, path_len, final, *extra)  # one wait for the device
    width = path.shape[1]
    paths = [flat_paths[b * width : b * width + lens[b]] for b in range(len(trees))]
    if not read:
        return [Verdict(p, finals[b]) for b, p in enumerate(paths)]
    node_lps, final_lps = read
    starts = list(accumulate((len(t) for t in trees), initial=0))
    return [Verdict(p, finals[b], [node_lps[starts[b] + c] for c in p] + [final_lps[b]]) for b, p in enumerate(paths)]


def emitted_logprobs(
    trees: Sequence[DraftTree], logprobs: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor, final: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, before any read: every draft node's logprob at its parent's row (what it
    is worth if accepted; the trees are known on the host), and each sequence's final token's at
    the row of its last accepted node (from the kernel's outputs)."""
    vocab = logprobs.shape[-1]
    first = np.fromiter(accumulate((len(t) + 1 for t in trees), initial=0), np.int64, len(trees) + 1)[:-1]
    nodes = [
        (first[b] + (p + 1 if p >= 0 else 0)) * vocab + tok
        for b, t in enumerate(trees)
        for tok, p in zip(t.tokens, t.parents)
    ]
    host = np.concatenate([first, np.asarray(nodes, dtype=np.int64)])
    index = to_device(host, logprobs.device)  # one queued copy: the rows' starts, the nodes' entries
    flat = logprobs.reshape(-1)
    last = path.long().gather(1, (path_len.long() - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    row = index[: len(trees)] + torch.where(path_len > 0, last + 1, torch.zeros_like(last))
    return flat.index_select(0, index[len(trees) :]), flat.index_select(0, row * vocab + final.long())
