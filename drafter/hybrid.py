"""The hybrid drafter: the model drafter's tree and the suffix drafter's tree in one verification.

Both drafters propose for the same sequences; :func:`merge_trees` fuses the two trees by longest
common prefix (a path both propose is verified once) and keeps at most ``budget`` nodes, the
model's first. The fused tree is verified as deterministic (one-hot) proposals, which is exact
for any proposal made independently of the verifier's randomness, however it was drawn.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from ..draft_contract import (
    Drafter,
    DraftRequest,
    DraftShape,
    DraftStep,
    DraftTree,
    SequenceView,
    Settled,
    draft_from_text,
)


def merge_trees(first: DraftTree, second: DraftTree, budget: int) -> DraftTree:
    """Fuse ``second`` into ``first`` by longest common prefix, within ``budget`` nodes.

    ``first``'s nodes keep their order and come first; ``second``'s nodes that extend a shared
    prefix or open new branches follow, breadth-first, until the budget is spent. Children keep
    their sibling order (within each source), so the more likely branch is tried first.
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(parent: int, token: int) -> int | None:
        key = (parent, token)
        if key in index:
            return index[key]
        if len(tokens) >= budget:
            return None
        index[key] = len(tokens)
        tokens.append(token)
        parents.append(parent)
        return index[key]

    for source in (first, second):
        mapped: dict[int, int] = {}
        for node in sorted(range(len(source)), key=lambda n: (source.depths[n], n)):
            parent = source.parents[node]
            if parent >= 0 and parent not in mapped:
                continue  # its parent did not fit
            new = add(mapped[parent] if parent >= 0 else -1, source.tokens[node])
            if new is not None:
                mapped[node] = new
    return DraftTree(tokens, parents)  # a node is always added after its parent


class HybridDrafter(Drafter):
    """Model drafter + suffix drafter, fused per sequence (strategy ``hybrid:D,K,B``). Its suffix
    half drafts from the host's text, so a hybrid step commits the step before it first (as a suffix
    step does: the device idles while the host drafts, verifies and commits, once a step)."""

    name = "hybrid"

    def __init__(self, model_drafter: Drafter, suffix_drafter: Drafter) -> None:  # both DraftsFromText
        self.model_drafter = model_drafter
        self.suffix_drafter = suffix_drafter
        self._model_chain: dict[int, list[int]] = {}  # seq -> the model's chain, when it proposed one

    def draft(self, step: DraftStep) -> list[DraftTree]:
        return draft_from_text(self, step)

    def propose(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        model_trees = self.model_drafter.propose(requests, shape)
        suffix_trees = self.suffix_drafter.propose(requests, shape)
        out = []
        for r, a, b in zip(requests, model_trees, suffix_trees):
            if a.is_chain and len(a):
                self._model_chain[r.seq.seq_id] = list(a.tokens)
            out.append(merge_trees(a, b, shape.max_nodes))
        return out

    def settled(self, seq: SequenceView, settled: Settled) -> None:
        """The model drafter keeps its chain's K/V only for the part verification took, which here
        may have followed a suffix branch: hand it the length of the common prefix."""
        chain, num_accepted = self._model_chain.pop(seq.seq_id, None), settled.kept
        common = 0
        if chain is not None:
            kept = seq.output_ids[len(seq.output_ids) - num_accepted - 1 : len(seq.output_ids) - 1]
            while common < min(len(chain), len(kept)) and chain[common] == kept[common]:
                common += 1
        self.model_drafter.settled(seq, Settled(common))
        self.suffix_drafter.settled(seq, settled)
