import pytest
import torch

from tailspec.drafter.base import DraftShape, DraftTree, owed_seconds
from tailspec.drafter.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.testing import perturbed_copy, tiny_random_model


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


def test_owed_seconds_splits_a_catch_up_by_rows():
    # rows beyond what one step leaves (3): 7 of the first sequence's 10, none of the others'
    assert owed_seconds(1.4, [10, 3, 1], steady_rows=3) == pytest.approx(1.4 * 7 / 14)
    assert owed_seconds(1.0, [3, 2], steady_rows=3) == 0.0
    assert owed_seconds(1.0, [], steady_rows=3) == 0.0


@pytest.mark.parametrize("kind", ["small_lm", "eagle3"])
def test_a_catch_up_after_plain_steps_is_reported_as_owed(kind):
    """The first model-drafter step after plain ones catches up on their tokens: that work is
    reported as owed (the adaptive selector leaves it out of the arm's goodput); the next step of
    the same drafter only catches up on its own emitted tokens and owes nothing."""
    model = tiny_random_model("llama", seed=1)
    if kind == "small_lm":
        drafter = perturbed_copy(model, noise=0.1, seed=2)
    else:
        torch.manual_seed(0)
        drafter = Eagle3Drafter(Eagle3Head(Eagle3Config.for_target(model.config)), model)
    engine = RolloutEngine(model, RolloutConfig(strategy="none"), drafter=drafter)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(12):  # the prefill and 11 plain steps
        engine.step()
    engine.set_strategy("chain:2")
    engine.step()
    wrapped = engine.drafter
    assert wrapped.catch_up_debt_s > 0
    engine.step()
    assert wrapped.catch_up_debt_s == 0.0
