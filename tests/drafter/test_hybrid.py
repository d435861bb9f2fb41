from tailspec.draft_contract import DraftTree
from tailspec.drafter.hybrid import merge_trees


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(tree)):
        path, n = [], i
        while n >= 0:
            path.append(tree.tokens[n])
            n = tree.parents[n]
        out.add(tuple(reversed(path)))
    return out


def test_shared_prefixes_are_verified_once():
    model = DraftTree.chain([5, 6, 7])
    suffix = DraftTree([5, 6, 9, 8], [-1, 0, 1, -1])  # 5-6-9 shares 5-6 with the model; 8 is a new branch
    merged = merge_trees(model, suffix, budget=16)
    assert paths(merged) == paths(model) | paths(suffix)
    assert len(merged) == 5  # 5, 6, 7, 9, 8: the shared 5-6 appears once
    assert merged.tokens[:3] == [5, 6, 7]  # the model's nodes first, in their order


def test_budget_keeps_the_model_first_and_whole_paths():
    model = DraftTree([1, 2, 3, 4], [-1, -1, 0, 1])
    suffix = DraftTree.chain([7, 8, 9])
    merged = merge_trees(model, suffix, budget=5)
    assert len(merged) == 5
    assert paths(model) <= paths(merged)
    assert (7,) in paths(merged) and (7, 8) not in paths(merged)
    for i, p in enumerate(merged.parents):  # a valid tree: parents precede children
        assert -1 <= p < i


def test_identical_or_empty_trees():
    tree = DraftTree([3, 4, 5], [-1, 0, 0])
    assert paths(merge_trees(tree, tree, 16)) == paths(tree) and len(merge_trees(tree, tree, 16)) == 3
    assert len(merge_trees(DraftTree(), DraftTree(), 8)) == 0
    assert paths(merge_trees(DraftTree(), tree, 8)) == paths(tree)
    sampled = DraftTree.chain([1, 2])
    assert merge_trees(sampled, DraftTree(), 4).draft_probs is None  # verified as deterministic proposals
