"""Every sequence's draft verified at once (``rollout/spec/verdicts.py``), against the walk of each
tree on its own (``verify.verify_each``, which the chi-square tests hold exact): chains and trees
on the device, and the host's batches of sampled drafts that share a shape."""

import numpy as np
import pytest
import torch

from tailspec.draft_contract import DraftTree
from tailspec.rollout.spec.device_tree import tree_rows
from tailspec.rollout.spec.verdicts import greedy_chain_verdicts, sampled_chain_verdicts, tree_verdicts
from tailspec.rollout.spec.verify import verify_batch, verify_each


def test_sampled_chain_verdicts_emit_the_targets_first_token_and_greedy_rows_their_argmax():
    """Every row of one batch verifies the same chain case: its first emitted token is the
    target's ``p_0`` exactly (accepted draft or residual sample), whatever the drafts' ``q``; a
    greedy row in the batch accepts and emits argmax tokens."""
    from rollout_helpers import chi_square_pvalue

    gen = torch.Generator().manual_seed(0)
    vocab, depth, rows = 5, 2, 40000
    p = torch.softmax(torch.randn(depth + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(depth, vocab, generator=gen) * 1.5, dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen) for j in range(depth)], 1)
    uniforms = torch.rand(rows, depth + 1, generator=gen, dtype=torch.float64)
    logprobs = p.log().repeat(rows, 1)
    greedy = torch.zeros(rows, dtype=torch.bool)
    greedy[-1] = True
    drafts[-1] = p[:depth].argmax(dim=-1)
    emitted, accepted, lps = sampled_chain_verdicts(logprobs, drafts, q.expand(rows, -1, -1), uniforms, greedy)
    counts = torch.bincount(emitted[:-1, 0], minlength=vocab)
    assert chi_square_pvalue(counts, p[0]) > 1e-3
    assert 0 < accepted[:-1].float().mean() < depth
    assert accepted[-1] == depth and emitted[-1].tolist() == p.argmax(dim=-1).tolist()
    assert torch.allclose(lps, p.log().gather(1, emitted.T).T)


def test_greedy_chain_verdicts_accept_up_to_the_first_mismatch():
    vocab = 6
    argmax = torch.tensor([[1, 2, 3, 4], [5, 5, 5, 5], [0, 1, 2, 3]])  # [B, k + 1]
    logits = torch.nn.functional.one_hot(argmax, vocab).float().reshape(-1, vocab) * 4.0
    drafts = torch.tensor([[1, 2, 0], [4, 5, 5], [0, 1, 2]])
    best, accepted, logprobs = greedy_chain_verdicts(torch.log_softmax(logits, dim=-1), drafts)
    assert best.tolist() == argmax.tolist()
    assert accepted.tolist() == [2, 0, 3]  # a match after the first mismatch does not count
    want = torch.log_softmax(torch.tensor([4.0] + [0.0] * (vocab - 1)), dim=0)[0].item()
    assert logprobs.flatten().tolist() == pytest.approx([want] * 12, abs=1e-6)


def _random_tree(rng: np.random.Generator, n: int, depth: int, topk: int, vocab: int) -> DraftTree:
    """``n`` nodes at most ``depth`` deep with at most ``topk`` children a node, siblings distinct."""
    parents, depths, children = [], [], {}
    for _ in range(n):
        options = [p for p in range(-1, len(parents)) if children.get(p, 0) < topk and (p < 0 or depths[p] < depth)]
        p = int(rng.choice(options))
        children[p] = children.get(p, 0) + 1
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
    tokens: list[int] = []
    for p in parents:
        taken = {t for t, q in zip(tokens, parents) if q == p}
        tokens.append(int(rng.choice([t for t in range(vocab) if t not in taken])))
    return DraftTree(tokens, parents)


@pytest.mark.parametrize("batch_kind", ["greedy", "mixed"])
def test_tree_verdicts_walk_every_tree_as_the_host_walks_one(batch_kind):
    """``tree_verdicts`` on the device, every tree at once, against ``verify_each``'s walk of each
    (the reference the chi-square tests hold exact) with the same uniforms: the same accepted
    nodes, final tokens, emitted tokens and logprobs; and ``tree_rows`` are the trees' own
    positions and ancestor masks."""
    rng, gen = np.random.default_rng(5), torch.Generator().manual_seed(5)
    depth, topk, vocab, batch = 4, 3, 6, 6
    for _ in range(40):
        n = int(rng.integers(1, 10))
        trees = [_random_tree(rng, n, depth, topk, vocab) for _ in range(batch)]
        tokens, parents = torch.tensor([t.tokens for t in trees]), torch.tensor([t.parents for t in trees])
        rows = tree_rows(parents, depth)
        for b, t in enumerate(trees):
            assert torch.equal(rows.visible[b], t.ancestor_mask()) and rows.offsets[b].tolist() == [0, *t.depths]
        logprobs = torch.log_softmax(torch.randn(batch * (n + 1), vocab, generator=gen) * 1.5, dim=-1)
        greedy = [True] * batch if batch_kind == "greedy" else [i % 3 == 0 for i in range(batch)]
        uniforms = torch.rand(batch, n + 1, generator=gen, dtype=torch.float64)
        want = verify_each(trees, logprobs, greedy, uniforms.reshape(-1))
        drawn = None if all(greedy) else uniforms
        emitted, accepted, path, lps = tree_verdicts(
            logprobs, tokens, parents, depth, topk, torch.tensor(greedy), drawn
        )
        for b, (t, v) in enumerate(zip(trees, want)):
            n_acc = int(accepted[b])
            assert path[b, :n_acc].tolist() == v.path
            assert emitted[b, : n_acc + 1].tolist() == [tok for tok, _ in v.emitted(t)]
            expected = [logprobs[b * (n + 1) + r, tok].item() for tok, r in v.emitted(t)]
            assert lps[b, : n_acc + 1].tolist() == pytest.approx(expected, abs=1e-6)


def _random_chain(rng: np.random.Generator, n: int, vocab: int, with_probs: bool) -> DraftTree:
    probs = torch.softmax(torch.from_numpy(rng.normal(size=(n, vocab))).float() * 2, dim=-1) if with_probs else None
    tokens = [int(t) for t in rng.integers(0, vocab, n)]
    return DraftTree.chain(tokens, probs)


def test_the_host_verifies_sampled_drafts_of_one_shape_together_as_it_walks_each():
    """``verify_batch`` on torch: sampled chains of one length (with and without the drafts'
    distributions) and deterministic trees of one size verified together, a tree with
    distributions, greedy rows and empty drafts walked on their own, in one mixed batch: every
    verdict is the one ``verify_each`` gives for the same uniforms."""
    rng, gen = np.random.default_rng(7), torch.Generator().manual_seed(7)
    vocab = 6
    for _ in range(30):
        trees, greedy = [], []
        for _ in range(12):
            kind = int(rng.integers(0, 5))
            n = int(rng.integers(1, 4))
            if kind == 0:
                tree = _random_chain(rng, n, vocab, with_probs=True)
            elif kind == 1:
                tree = _random_chain(rng, n, vocab, with_probs=False)
            elif kind == 2:
                tree = _random_tree(rng, 4, 3, 2, vocab)
            elif kind == 3:  # a tree drafted with distributions: walked on its own
                tree = _random_tree(rng, 3, 2, 2, vocab)
                tree = DraftTree(tree.tokens, tree.parents, torch.softmax(torch.randn(3, vocab, generator=gen), -1))
            else:
                tree = DraftTree.chain([])
            trees.append(tree)
            greedy.append(bool(rng.random() < 0.2))
        rows = sum(len(t) + 1 for t in trees)
        logprobs = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 1.5, dim=-1)
        uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
        got = verify_batch(trees, logprobs, greedy, uniforms, backend="torch")
        want = verify_each(trees, logprobs, greedy, uniforms)
        assert [(v.path, v.final_token) for v in got] == [(v.path, v.final_token) for v in want]
