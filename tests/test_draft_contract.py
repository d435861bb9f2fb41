import pytest
import torch

from tailspec.draft_contract import DraftShape, DraftTree


def test_tree_structure_helpers():
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 2])
    assert tree.depths == [1, 1, 2, 2, 3]
    assert tree.children == [[0, 1], [2, 3], [], [4], [], []]
    assert not tree.is_chain
    mask = tree.ancestor_mask()
    # row = root + nodes; node 4 sees the root, node 0, node 2 and itself
    assert mask[5].tolist() == [True, True, False, True, False, True]
    assert mask[2].tolist() == [True, False, True, False, False, False]
    assert torch.all(mask[:, 0])


def test_chain_and_truncation():
    chain = DraftTree.chain([5, 6, 7], torch.full((3, 4), 0.25))
    assert chain.is_chain and chain.depths == [1, 2, 3]
    cut = chain.truncated(2)
    assert cut.tokens == [5, 6] and cut.draft_probs.shape == (2, 4)
    assert chain.truncated(10) is chain
    assert DraftTree.chain([]).ancestor_mask().shape == (1, 1)


@pytest.mark.parametrize(
    "tokens,parents,probs",
    [([1, 2], [-1], None), ([1, 2], [-1, 1], None), ([1], [-2], None), ([1, 2], [-1, 0], torch.zeros(3, 4))],
)
def test_malformed_trees_are_refused(tokens, parents, probs):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents, probs)


@pytest.mark.parametrize("kwargs", [dict(depth=0), dict(depth=65), dict(depth=2, topk=0), dict(depth=4, budget=3)])
def test_bad_shapes_are_refused(kwargs):
    with pytest.raises(ValueError):
        DraftShape(**kwargs)


def test_shape_node_count():
    assert DraftShape(4).max_nodes == 4 and DraftShape(4).is_chain
    assert DraftShape(3, 2).max_nodes == 6
    assert DraftShape(3, 2, 5).max_nodes == 5
