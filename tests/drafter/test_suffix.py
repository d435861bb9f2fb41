import pytest

from tailspec.drafter import DraftRequest, DraftShape, SuffixDrafter
from tailspec.drafter.suffix import NgramIndex
from tailspec.rollout import SamplingParams
from tailspec.rollout.request import Sequence


def _seq(seq_id, prompt, output=(), group=None, stop=frozenset({1})):
    s = Sequence(seq_id, list(prompt), SamplingParams(temperature=0.0), stop, group=group)
    s.output_ids = list(output)
    return s


def test_ngram_counts_and_uncounting():
    index = NgramIndex(max_order=2)
    index.add([1, 2, 3, 1, 2, 4])
    assert index.next_counts([1, 2], 2) == {3: 1, 4: 1}
    assert index.next_counts([2], 1) == {3: 1, 4: 1}
    assert index.next_counts([3], 1) == {1: 1}
    index.add([1, 2, 3, 1, 2, 4], sign=-1)
    assert len(index) == 0


def test_drafts_the_most_frequent_continuation_first():
    drafter = SuffixDrafter(max_order=3)
    seq = _seq(0, [7, 8, 9, 7, 8, 9, 7, 8, 5, 7, 8])
    (tree,) = drafter.propose([DraftRequest(seq, 4)], DraftShape(4, 2, 6))
    assert tree.tokens[0] == 9  # "7 8" was followed by 9 twice and by 5 once
    first, second = tree.children[0]
    assert (tree.tokens[first], tree.tokens[second]) == (9, 5)  # siblings: more frequent first
    assert tree.tokens[tree.children[first + 1][0]] == 7  # then "8 9" -> 7


def test_chain_shape_and_depth_limit():
    drafter = SuffixDrafter()
    seq = _seq(0, [4, 5, 6, 4, 5, 6, 4, 5, 6, 4])
    (tree,) = drafter.propose([DraftRequest(seq, 3)], DraftShape(8))
    assert tree.is_chain and tree.tokens == [5, 6, 4]


def test_stop_tokens_end_a_branch():
    drafter = SuffixDrafter()
    seq = _seq(0, [4, 5, 1, 9, 4, 5, 1, 9, 4])
    (tree,) = drafter.propose([DraftRequest(seq, 6)], DraftShape(6))
    assert tree.tokens == [5, 1]


def test_group_members_share_an_index_and_history_is_bounded():
    drafter = SuffixDrafter(max_order=4, history_tokens=10)
    leader = _seq(0, [2, 3], output=[10, 11, 12, 13, 14], group=5)
    follower = _seq(1, [2, 3], output=[10], group=5)
    drafter.propose([DraftRequest(leader, 4)], DraftShape(4))
    (tree,) = drafter.propose([DraftRequest(follower, 4)], DraftShape(4))
    assert tree.tokens == [11, 12, 13, 14]
    drafter.finished(leader)
    drafter.release(0)
    drafter.release(1)
    assert not drafter._groups
    for i in range(5):
        drafter.remember([20 + i] * 4)
    assert drafter._history_size <= 10
    # only the newest completions are remembered
    assert drafter.history.next_counts([24], 1) == {24: 3}
    assert drafter.history.next_counts([20], 1) is None


def test_a_prompt_seen_before_drafts_from_its_own_earlier_completions():
    """Both prompts' earlier completions are in the global history with conflicting continuations
    of "40 41"; a new group of prompt A starts with A's own in its index, so A's wins."""
    drafter = SuffixDrafter(max_order=2, history_tokens=1000, prompt_history=2)
    a, b = [2, 3], [4, 5]
    for i, (prompt, follow) in enumerate([(a, 50), (b, 60), (b, 60)]):
        done = _seq(i, prompt, output=[40, 41, follow, 9], group=10 + i)
        drafter.propose([DraftRequest(done, 2)], DraftShape(2))
        drafter.finished(done)
        drafter.release(i)
    (tree,) = drafter.propose([DraftRequest(_seq(7, a, output=[40, 41], group=20), 1)], DraftShape(1))
    assert tree.tokens == [50]  # global history alone says 60 (twice vs once)
    (tree,) = drafter.propose([DraftRequest(_seq(8, [6, 6], output=[40, 41], group=21), 1)], DraftShape(1))
    assert tree.tokens == [60]  # an unseen prompt: the global history
    state = drafter.state_dict()
    again = SuffixDrafter(max_order=2, history_tokens=1000, prompt_history=2)
    again.load_state_dict(state)
    assert again.state_dict() == state
    (tree,) = again.propose([DraftRequest(_seq(9, a, output=[40, 41], group=30), 1)], DraftShape(1))
    assert tree.tokens == [50]


@pytest.mark.parametrize(
    "kwargs", [dict(max_order=0), dict(history_tokens=-1), dict(group_weight=0), dict(prompt_history=-1)]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SuffixDrafter(**kwargs)


def test_remembered_completions_are_counted_when_read_and_forgotten_exactly():
    """The history counts a completion when a draft next reads it; completions forgotten before
    that (and ones counted earlier) leave an index equal to counting what is kept, in one go."""
    drafter = SuffixDrafter(max_order=3, history_tokens=12)
    docs = [[30 + (i * 7 + j) % 5 for j in range(3 + i % 3)] for i in range(9)]
    for i, doc in enumerate(docs):
        drafter.remember(doc)
        if i % 3 == 1:
            assert len(drafter.history) and drafter._unindexed == 0  # counted here; later ones wait
        kept = list(drafter._history_docs)
        assert sum(map(len, kept)) <= 12 and kept == docs[i + 1 - len(kept) : i + 1]
    reference = NgramIndex(3)
    for doc in drafter._history_docs:
        reference.add(doc)
    assert drafter.history.counts == reference.counts
