"""Verification rules on synthetic distributions: greedy walks, and Monte Carlo checks that
every emitted token follows the target distribution exactly, for chains, multi-draft trees,
stochastic and deterministic drafts; the same check rejects deliberately wrong rules."""

import pytest
import torch
from rollout_helpers import chi_square_pvalue

from tailspec.draft_contract import DraftTree
from tailspec.rollout.spec import verify as verify_module
from tailspec.rollout.spec.verify import residual, verify_greedy, verify_sampled

V = 6
N = 4000  # samples per check: both wrong rules below fail at p < 1e-100


def _dist(seed: int, zeros: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g, dtype=torch.float64) ** 2
    if zeros:
        p[torch.randperm(V, generator=g)[:zeros]] = 0.0  # like a top-k / top-p filtered target
    return p / p.sum()


P_ROOT = _dist(1, zeros=1)
P_NEXT = torch.stack([_dist(10 + t) for t in range(V)])  # target at depth 2 given the first token
Q_ROOT = _dist(2)
Q_NEXT = torch.stack([_dist(20 + t) for t in range(V)])
JOINT = (P_ROOT.unsqueeze(1) * P_NEXT).reshape(-1)  # exact distribution of the first two tokens


def _sample(p: torch.Tensor, g: torch.Generator) -> int:
    return int(torch.multinomial(p.float(), 1, generator=g))


def _uniforms(tree: DraftTree, g: torch.Generator) -> torch.Tensor:
    return torch.rand(len(tree) + 1, generator=g, dtype=torch.float64)


def _target(tree: DraftTree):
    def probs(row: int) -> torch.Tensor:
        if row == 0:
            return P_ROOT.clone()
        node = row - 1
        if tree.depths[node] == 1:
            return P_NEXT[tree.tokens[node]].clone()
        return _dist(99)  # deeper rows are not scored by these tests

    return probs


def _first_two(tree: DraftTree, verdict) -> tuple[int, int] | None:
    tokens = [tok for tok, _ in verdict.emitted(tree)]
    return (tokens[0], tokens[1]) if len(tokens) >= 2 else None


def draft_chain_stochastic(g):
    t1 = _sample(Q_ROOT, g)
    t2 = _sample(Q_NEXT[t1], g)
    return DraftTree.chain([t1, t2], torch.stack([Q_ROOT, Q_NEXT[t1]]))


def draft_chain_deterministic(g):
    return DraftTree.chain([int(Q_ROOT.argmax()), 3])


def draft_tree_iid(g):
    """Three i.i.d. children of the root from q, each with one sampled child: exact multi-draft."""
    tokens, parents, rows = [], [], []
    for _ in range(3):
        tokens.append(_sample(Q_ROOT, g))
        parents.append(-1)
        rows.append(Q_ROOT)
    for c in range(3):
        tokens.append(_sample(Q_NEXT[tokens[c]], g))
        parents.append(c)
        rows.append(Q_NEXT[tokens[c]])
    return DraftTree(tokens, parents, torch.stack(rows))


def draft_tree_topk(g):
    """Deterministic top-3 children of the root, two children under the first (one-hot drafts)."""
    top = torch.topk(Q_ROOT, 3).indices.tolist()
    return DraftTree(top + [0, 5], [-1, -1, -1, 0, 0])


DRAFTERS = [draft_chain_stochastic, draft_chain_deterministic, draft_tree_iid, draft_tree_topk]


def joint_counts(draft, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V, dtype=torch.long)
    for _ in range(n):
        tree = draft(g)
        verdict = verify_sampled(tree, _target(tree), _uniforms(tree, g))
        pair = _first_two(tree, verdict)
        if pair is None:  # first token was a correction: draw the second from the target directly
            first = verdict.final_token
            pair = (first, _sample(P_NEXT[first], g))
        counts[pair[0] * V + pair[1]] += 1
    return counts


@pytest.mark.parametrize("draft", DRAFTERS, ids=lambda f: f.__name__)
def test_emitted_tokens_follow_the_target_exactly(draft):
    counts = joint_counts(draft, N, seed=0)
    assert chi_square_pvalue(counts, JOINT) > 1e-3


@pytest.mark.parametrize(
    "wrong_residual",
    [lambda p, q, token: p, lambda p, q, token: q if q is not None else p],
    ids=["resample_from_target", "resample_from_draft"],
)
def test_the_check_rejects_a_wrong_rule(monkeypatch, wrong_residual):
    monkeypatch.setattr(verify_module, "residual", wrong_residual)
    counts = joint_counts(draft_chain_stochastic, N, seed=0)
    try:
        pvalue = chi_square_pvalue(counts, JOINT)
    except AssertionError:  # it even emitted a token of probability zero
        pvalue = 0.0
    assert pvalue < 1e-6


def test_residual_is_normalized_and_excludes_the_rejected_token():
    r = residual(P_ROOT, None, 2)
    assert r[2] == 0 and float(r.sum()) == pytest.approx(1.0)
    r = residual(P_ROOT, Q_ROOT, 0)
    assert torch.all(r >= 0) and float(r.sum()) == pytest.approx(1.0)
    assert torch.all(r[P_ROOT <= Q_ROOT] == 0)
    assert torch.equal(residual(P_ROOT, P_ROOT, 0), P_ROOT)  # p == q: nothing to correct


def test_zero_probability_tokens_are_never_emitted():
    g = torch.Generator().manual_seed(3)
    banned = int((P_ROOT == 0).nonzero()[0])
    tree = DraftTree.chain([banned, 1])  # a draft of a token the target has filtered out
    for _ in range(500):
        verdict = verify_sampled(tree, _target(tree), _uniforms(tree, g))
        assert verdict.path == [] and verdict.final_token != banned


def test_greedy_follows_the_argmax_child():
    tree = DraftTree([4, 7, 9, 2, 5], [-1, -1, 1, 1, 3])
    argmax = [7, 0, 2, 0, 5, 0]  # root -> 7 (node 1) -> 2 (node 3) -> 5 (node 4) -> bonus 0
    verdict = verify_greedy(tree, argmax)
    assert verdict.path == [1, 3, 4]
    assert verdict.final_token == argmax[5]
    assert verdict.emitted(tree) == [(7, 0), (2, 2), (5, 4), (0, 5)]


def test_greedy_rejects_at_the_root():
    tree = DraftTree.chain([3, 4])
    verdict = verify_greedy(tree, [8, 4, 4])
    assert verdict.path == [] and verdict.final_token == 8


def test_bonus_token_after_a_fully_accepted_chain():
    tree = DraftTree.chain([3, 4])
    g = torch.Generator().manual_seed(0)

    def certain(row: int) -> torch.Tensor:
        p = torch.zeros(V, dtype=torch.float64)
        p[[3, 4, 5][row]] = 1.0
        return p

    verdict = verify_sampled(tree, certain, _uniforms(tree, g))
    assert verdict.path == [0, 1] and verdict.final_token == 5


def test_the_fused_kernels_verdicts_carry_the_emitted_tokens_logprobs():
    """With ``emitted_from``, the Triton path reads each emitted token's logprob (under that
    distribution, not the scores verified on) with the verdicts, so accepting reads nothing more."""
    gen = torch.Generator().manual_seed(3)
    vocab = 12
    trees = [
        DraftTree.chain([3, 5, 7]),
        DraftTree([1, 2, 4, 9], [-1, -1, 0, 0]),
        DraftTree(),  # a sequence that did not draft
        DraftTree.chain([0, 0]),
    ]
    rows = sum(len(t) + 1 for t in trees)
    scores = torch.log_softmax(torch.randn(rows, vocab, generator=gen), dim=-1)
    reported = torch.log_softmax(torch.randn(rows, vocab, generator=gen), dim=-1)
    greedy = [False, True, False, False]
    for seed in range(5):
        uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        fused = verify_module.verify_batch(trees, scores, greedy, uniforms, backend="triton", emitted_from=reported)
        plain = verify_module.verify_batch(trees, scores, greedy, uniforms, backend="triton")
        first = 0
        for tree, verdict, same in zip(trees, fused, plain):
            assert (verdict.path, verdict.final_token) == (same.path, same.final_token) and same.logprobs is None
            expected = [reported[first + row, token].item() for token, row in verdict.emitted(tree)]
            assert verdict.logprobs == pytest.approx(expected, abs=0, rel=1e-12)
            first += len(tree) + 1
