"""Static best-first trees grown on the device (drafter/tree_search.py ``grow_static_trees``), the
drafts of a tree step launched from state on the device."""

import pytest
import torch

from tailspec.draft_contract import DraftShape, DraftTree, static_tree_nodes
from tailspec.drafter.tree_search import grow_static_trees


@pytest.mark.parametrize(("depth", "topk", "budget"), [(4, 2, 8), (3, 3, 10), (5, 2, 40), (2, 4, 6), (1, 3, 3)])
def test_static_trees_hold_the_best_nodes_of_their_levels_with_their_ancestors(depth, topk, budget):
    """With a drafter whose next-token log-probabilities depend on the last token (a table), the
    tree holds the ``n`` best of what the levels expanded (level 1: the root's ``topk`` best; each
    further level: the ``topk`` best children of the ``topk`` best nodes of the level before),
    every node's parent among them, in topological order with siblings best first."""
    gen = torch.Generator().manual_seed(depth * 10 + topk)
    vocab, batch = 40, 3
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=gen) * 3, dim=-1)
    root = torch.log_softmax(torch.randn(batch, vocab, generator=gen) * 3, dim=-1)
    shape = DraftShape(depth, topk, budget)
    tokens, parents = grow_static_trees(root, shape, lambda paths, _: table[paths[:, :, -1]])
    assert tokens.shape == parents.shape == (batch, static_tree_nodes(shape))
    for b in range(batch):
        tree = DraftTree(tokens[b].tolist(), parents[b].tolist())  # checks parents precede children
        scores: list[float] = []
        for token, parent in zip(tree.tokens, tree.parents):
            scores.append(
                float(root[b, token]) if parent < 0 else scores[parent] + float(table[tree.tokens[parent], token])
            )
        # the reference search: each level's candidates as (score, path), the frontier its topk best
        level = [(float(s), (int(t),)) for s, t in zip(*root[b].topk(topk))]
        expanded = list(level)
        for _ in range(depth - 1):
            frontier = sorted(level, key=lambda c: -c[0])[:topk]
            level = [
                (s + float(table[path[-1], t]), (*path, int(t)))
                for s, path in frontier
                for t in table[path[-1]].topk(topk).indices
            ]
            expanded += level
        best = sorted((s for s, _ in expanded), reverse=True)[: len(tree)]
        assert sorted(scores, reverse=True) == pytest.approx(best, abs=1e-5)
        assert max(tree.depths) <= depth and all(len(c) <= topk for c in tree.children)
        for siblings in tree.children:
            assert [scores[i] for i in siblings] == sorted((scores[i] for i in siblings), reverse=True)
        paths = {tuple(tree.tokens[a] for a in reversed([i, *_ancestors(tree, i)])) for i in range(len(tree))}
        assert len(paths) == len(tree)  # no path drafted twice


def _ancestors(tree: DraftTree, i: int) -> list[int]:
    out, node = [], tree.parents[i]
    while node >= 0:
        out.append(node)
        node = tree.parents[node]
    return out


def test_each_level_says_which_path_of_the_level_before_each_path_extends():
    """A drafter carrying state along a path (the EAGLE-3 head's hidden outputs) finds it through
    ``extends``: a level's path minus its last token is the earlier level's path it names."""
    gen = torch.Generator().manual_seed(3)
    vocab, batch, shape = 30, 2, DraftShape(5, 3, 20)
    table = torch.log_softmax(torch.randn(vocab, vocab, generator=gen) * 3, dim=-1)
    root = torch.log_softmax(torch.randn(batch, vocab, generator=gen) * 3, dim=-1)
    calls = []

    def level(paths, extends):
        calls.append((paths, extends))
        return table[paths[:, :, -1]]

    grow_static_trees(root, shape, level)
    assert len(calls) == shape.depth - 1 and calls[0][1] is None
    for (before, _), (paths, extends) in zip(calls, calls[1:]):
        assert extends.shape == (batch, shape.topk)
        assert torch.equal(paths[:, :, :-1], before.gather(1, extends.unsqueeze(2).expand(-1, -1, before.shape[2])))
