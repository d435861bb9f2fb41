import pytest
import torch

from tailspec.draft_contract import Drafter, DraftShape, DraftStep, DraftTree, Settled


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


# -- the drafter contract as a user meets it: one abstract method, the state picked through the step --


class _RepeatDrafter(Drafter):
    """A user's drafter implementing only what it must: ``draft`` (from the host's text), a chain
    repeating each sequence's last token; it records what the engine tells it was kept."""

    name = "repeat"

    def __init__(self) -> None:
        self.kept: list[int] = []
        self.released: set[int] = set()

    def draft(self, step: DraftStep) -> list[DraftTree]:
        requests = step.on_host()
        last = [r.seq.token_at(r.seq.num_tokens - 1) for r in requests]
        return [DraftTree.chain([t] * r.max_depth) for r, t in zip(requests, last)]

    def settled(self, seq, settled: Settled) -> None:
        self.kept.append(settled.kept)

    def release(self, seq_id: int) -> None:
        self.released.add(seq_id)


def _plain(model, prompts, params):
    from tailspec.rollout import RolloutConfig, RolloutEngine

    return [o.completion_ids for o in RolloutEngine(model, RolloutConfig()).generate(prompts, params)]


def test_a_user_drafter_with_only_draft_decodes_plain_decoding_s_tokens():
    from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
    from tailspec.testing import random_prompts, tiny_random_model

    model = tiny_random_model("llama", seed=3)
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    drafter = _RepeatDrafter()
    engine = RolloutEngine(model, RolloutConfig(strategy="chain:3"), drafter=drafter)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [engine.pop_output(i).completion_ids for i in ids] == _plain(model, prompts, params)
    assert drafter.kept and all(0 <= k <= 3 for k in drafter.kept)
    assert drafter.released == set(ids)  # every finished sequence's state released


class _Careless(_RepeatDrafter):
    def __init__(self, ask: bool, extra: int) -> None:
        super().__init__()
        self.ask, self.extra = ask, extra

    def draft(self, step: DraftStep) -> list[DraftTree]:
        n = len(step.on_host()) if self.ask else 1
        return [DraftTree.chain([5])] * (n + self.extra)


@pytest.mark.parametrize(
    "ask,extra,error",
    [(False, 0, "the repeat drafter returned draft trees without asking step.on_host"), (True, 1, "returned 3 draft")],
)
def test_a_drafter_that_breaks_the_step_s_contract_is_named(ask, extra, error):
    from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
    from tailspec.testing import random_prompts, tiny_random_model

    engine = RolloutEngine(tiny_random_model("llama"), RolloutConfig(strategy="chain:2"), drafter=_Careless(ask, extra))
    with pytest.raises((RuntimeError, ValueError), match=error):
        engine.generate(random_prompts(2, seed=1), SamplingParams(max_new_tokens=6, temperature=0.0))


def test_mirror_steps_refuse_a_drafter_that_drafts_no_branches():
    from tailspec.rollout import RolloutConfig, RolloutEngine
    from tailspec.testing import tiny_random_model

    config = RolloutConfig(strategy="mirror:chain:2,k=1")
    with pytest.raises(ValueError, match="mirror strategies need a drafter that drafts branches .* the repeat drafter"):
        RolloutEngine(tiny_random_model("llama"), config, drafter=_RepeatDrafter())


def test_the_drafter_contract_is_seven_methods_with_draft_the_only_abstract_one():
    """What a drafter may be asked to implement: at most eight methods, one way to draft."""
    methods = {name for name, value in vars(Drafter).items() if callable(value) and not name.startswith("_")}
    assert methods == {"bind", "fit_problems", "draft", "settled", "observe_batch", "finished", "release"}
    assert Drafter.__abstractmethods__ == frozenset({"draft"})
    assert DraftStep.__abstractmethods__ == frozenset({"on_device", "on_host"})  # the two states to draft from
