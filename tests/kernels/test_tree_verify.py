"""The fused Triton verification kernel against the torch reference (``rollout/spec/verify.py``):
given the same random draws, every accept decision, accepted path and final token is equal.
Without CUDA the kernel runs in Triton's interpreter."""

import pytest
import torch

from tailspec.draft_contract import DraftTree
from tailspec.kernels.tree_verify import pack_trees
from tailspec.rollout.spec.verify import verify_batch

pytest.importorskip("triton")


def random_tree(g: torch.Generator, vocab: int, max_nodes: int, stochastic: bool) -> DraftTree:
    n = int(torch.randint(0, max_nodes + 1, (1,), generator=g))
    parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
    tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
    q = torch.softmax(torch.randn(n, vocab, generator=g) * 3, dim=-1) if stochastic and n else None
    if q is not None:  # drawn from q, as a sampling drafter would
        tokens = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
    return DraftTree(tokens, parents, q)


def target_logprobs(g: torch.Generator, rows: int, vocab: int, sharp: float, filtered: bool) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=g) * sharp
    if filtered:  # top-k style: most tokens have probability exactly zero
        kth = logits.topk(min(5, vocab), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("vocab", [7, 96, 1500])  # 1500: the vocab spans two kernel blocks
@pytest.mark.parametrize("kind", ["chains", "trees", "mixed"])
def test_kernel_equals_reference(vocab, kind):
    g = torch.Generator().manual_seed(vocab + len(kind))
    for trial in range(4):
        trees = []
        for _ in range(9):
            stochastic = bool(torch.rand(1, generator=g) < 0.5)
            tree = random_tree(g, vocab, 7, stochastic)
            if kind == "chains" or (kind == "mixed" and torch.rand(1, generator=g) < 0.5):
                tree = DraftTree.chain(tree.tokens, tree.draft_probs)
            trees.append(tree)
        rows = sum(len(t) + 1 for t in trees)
        # a sharp target accepts often (long paths), a flat one rejects often (residuals, siblings)
        logprobs = target_logprobs(g, rows, vocab, sharp=[0.5, 4.0][trial % 2], filtered=trial >= 2)
        greedy = [bool(torch.rand(1, generator=g) < 0.3) for _ in trees]
        uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
        want = verify_batch(trees, logprobs, greedy, uniforms, backend="torch")
        got = verify_batch(trees, logprobs, greedy, uniforms, backend="triton")
        assert [(v.path, v.final_token) for v in got] == [(v.path, v.final_token) for v in want]


def test_deep_acceptance_and_bonus_tokens():
    """Drafts equal to the target's argmax under a near-deterministic target: whole chains and the
    matching branch of each tree are accepted, then the bonus token is drawn at the leaf."""
    vocab, g = 50, torch.Generator().manual_seed(0)
    chain = DraftTree.chain([4, 9, 2])
    tree = DraftTree([8, 3, 5, 6], [-1, -1, 1, 2])  # the root's second child leads on
    rows = len(chain) + 1 + len(tree) + 1
    logits = torch.full((rows, vocab), -30.0)
    wanted = [4, 9, 2, 11, 3, 0, 5, 6, 12]  # per row: chain root..leaf, then tree root, nodes 0..3
    logits[torch.arange(rows), wanted] = 30.0
    logprobs = torch.log_softmax(logits, dim=-1)
    for greedy in ([True, True], [False, False], [True, False]):
        uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
        for backend in ("torch", "triton"):
            verdicts = verify_batch([chain, tree], logprobs, greedy, uniforms, backend=backend)
            assert (verdicts[0].path, verdicts[0].final_token) == ([0, 1, 2], 11)
            assert (verdicts[1].path, verdicts[1].final_token) == ([1, 2, 3], 12)


def test_zero_probability_drafts_are_rejected_and_never_emitted():
    vocab = 30
    logprobs = target_logprobs(torch.Generator().manual_seed(1), 3, vocab, sharp=1.0, filtered=True)
    banned = int(torch.isinf(logprobs[0]).nonzero()[0])
    tree = DraftTree.chain([banned, banned])
    for seed in range(20):
        uniforms = torch.rand(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        verdict = verify_batch([tree], logprobs, [False], uniforms, backend="triton")[0]
        assert verdict.path == [] and torch.isfinite(logprobs[0, verdict.final_token])


def test_packing_lists_children_in_sibling_order():
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 1])
    packed = pack_trees([DraftTree.chain([1]), tree], vocab=10, device=torch.device("cpu"))
    assert packed.row_start.tolist() == [0, 2] and packed.node_start.tolist() == [0, 1]
    # rows of the second tree: root -> node 0, node 0 -> node 2, node 1 -> node 4
    assert packed.first_child.tolist() == [0, -1, 0, 2, 4, -1, -1, -1]
    assert packed.next_sibling.tolist() == [-1, 1, -1, 3, -1, -1]
    assert packed.max_depth == 2
