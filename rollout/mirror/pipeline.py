"""Mirror speculative decoding: the next round's draft is made while the target verifies this one.

A mirror step (strategy ``mirror:S,k=N``) runs like any speculative step, with two additions:

1. **overlap**: beside the verification forward the draft executor
   (``rollout/mirror/executors.py``) drafts *branches*, each a whole draft of shape ``S`` for the
   sequence as it would stand if the round emitted some guessed tokens:

   * from the start of the forward, the drafter's own **continuation** of each chain
     (PEARL-style post-verify): assume the chain is accepted whole and let the drafter go on, its
     own next token standing for the target's bonus token;
   * at the forward's **early exit** (after ``exit_layer`` layers, ``rollout/model/early_exit.py``)
     ``N`` more guesses from the target's own top candidates (:func:`plan_branches`: the whole
     draft plus a bonus candidate, and with ``N > 1`` the rejection the early exit predicts).
2. **settle**: after verification, a branch whose assumed tokens are exactly the tokens the round
   emitted is the sequence's draft for the next round (no drafting on the critical path then);
   other sequences are drafted serially at the next step, as in a plain ``S`` step.

Lossless: a ready draft was drawn from the drafter given exactly the tokens the sequence now has,
with the drafter's own random stream, independent of the verification's draws; the verifier sees
it as any other draft (with its draft distribution). Which branch is kept depends only on the
emitted tokens, so the kept draft is a draft from ``q`` for that prefix.

The drafter's state may hold K/V of branch tokens that were not emitted: after each step the
pipeline compares what the drafter last drafted from with the sequence's real tokens and
truncates the drafter's state to where they agree (``DraftsBranches.truncate``); before a mirror step it
does the same against whatever happened in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass, field

from ...draft_contract import BranchView, DraftRequest, DraftsBranches, DraftShape, DraftTree
from ..model.early_exit import EarlyExit
from ..request import Sequence
from ..spec.kv_blocks import max_draft_depth
from ..strategy import Strategy
from .executors import DraftExecutor, ExecutorError

logger = logging.getLogger(__name__)


def plan_branches(tree: DraftTree, exit_topk: Seq[Seq[int]], k: int) -> list[list[int]]:
    """Up to ``k`` guesses of the tokens this round will emit, likeliest first, from the early
    exit's candidates at each of the tree's rows (0 = the root, ``i + 1`` = node ``i``).

    A model drafter's draft is usually accepted whole, and the early exit is a far better judge of
    the one token after it than of each of the draft's tokens (its errors compound over a
    chain). So the first guesses trust the draft: its first-listed path (the likeliest), then
    the early exit's candidates for the bonus token at the leaf. The last guess, when ``k > 1``,
    is the rejection the early exit itself predicts: the first row on that path where its first
    choice is not the draft's token, with that choice as the correction.
    """
    path, row = [], 0
    while tree.children[row]:
        child = tree.children[row][0]
        path.append(child)
        row = child + 1
    tokens = [tree.tokens[c] for c in path]
    bonus = [[*tokens, t] for t in exit_topk[row][: k - 1 if k > 1 else 1]]
    disagreement = None
    for depth, child in enumerate(path):
        parent_row = 0 if depth == 0 else path[depth - 1] + 1
        choice = exit_topk[parent_row][0]
        if choice != tree.tokens[child]:
            siblings = {tree.tokens[c] for c in tree.children[parent_row]}
            if choice not in siblings:
                disagreement = [*tokens[:depth], choice]
            break
    guesses = bonus + ([disagreement] if disagreement is not None and k > 1 else [])
    if k > 1 and disagreement is None:
        guesses = [[*tokens, t] for t in exit_topk[row][:k]]
    return guesses


def agreeing_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class MirrorStats:
    steps: int = 0
    rounds: int = 0  # sequence-rounds run by mirror steps
    ready: int = 0  # ... whose draft was ready (a branch matched)
    ready_continued: int = 0  # ... of them from the drafter's own continuation
    branches: int = 0  # branches drafted beside the target
    early_exits: int = 0  # verification forwards whose early exit fired
    serial_draft_s: float = 0.0  # drafting left on the critical path (sequences with no ready draft)
    wait_s: float = 0.0  # time settle waited for the executor after verification
    executor_failures: int = 0
    executor_switches: int = 0  # to a peer's draft host and back (use_executor)

    @property
    def reuse_rate(self) -> float:
        return self.ready / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, "reuse_rate": self.reuse_rate}


@dataclass
class _Branch:
    """A branch drafting beside the forward: sequence ``index`` of the batch, the tokens assumed
    emitted (None for a continuation until its first drafted token is known), and whether the
    drafter's own state (not a fork) drafts it."""

    index: int
    assumed: list[int] | None
    held: bool
    call: int = 0  # which executor call drafts it
    continued: bool = False

    def __post_init__(self) -> None:
        self.continued = self.assumed is None


@dataclass
class _Held:
    """Tokens from position ``start`` that the drafter's state may hold K/V for (what it last drafted from)."""

    start: int
    tokens: list[int] = field(default_factory=list)


class MirrorPipeline:
    """The mirror step's drafting: ready drafts, the early-exit launch and the settling after verify."""

    def __init__(self, target, executor: DraftExecutor, exit_layer: int, fallback: DraftsBranches) -> None:
        self.executor = executor
        self.fallback = fallback  # the in-process drafter, used serially once the executor has failed
        self.exit_layer = exit_layer
        self._target = target
        self._exits: dict[int, EarlyExit] = {}
        # seq_id -> (the sequence's length it was kept at, the draft, its strategy); a sequence only
        # grows by appending, so the same length means the same tokens
        self._ready: dict[int, tuple[int, DraftTree, Strategy]] = {}
        self._held: dict[int, _Held] = {}
        self._branches: list[_Branch] = []  # what the executor is drafting, in the order it returns them
        self.stats = MirrorStats()
        self._own = executor  # the engine's own executor; a peer's (use_executor) may stand in for it
        self._own_failed = False

    @property
    def failed(self) -> bool:
        """The engine's own executor failed: drafting is serial from now on (a failed peer only
        hands drafting back to the own executor)."""
        return self.executor is self._own and self._own_failed

    @property
    def drafter(self) -> DraftsBranches:
        return self.fallback if self.failed else self.executor.drafter

    def use_executor(self, executor: DraftExecutor | None, seq_ids: Iterable[int]) -> None:
        """Draft on ``executor`` (a peer's draft host) from the next step on, or on the engine's own
        executor again (None). Called between steps, when nothing is in flight. The outgoing
        drafter forgets ``seq_ids`` (it would miss their updates from now on); the incoming one
        catches up on each sequence from its tokens. Ready drafts are tokens and stay valid."""
        incoming = executor if executor is not None else self._own
        if incoming is self.executor:
            return
        outgoing = self.drafter
        if outgoing is not self.fallback:  # the engine's own drafter also serves its serial arms
            for seq_id in seq_ids:
                outgoing.release(seq_id)
        if self.executor is not self._own:
            self.executor.close()
        self.executor = incoming
        self._held.clear()
        self._branches = []
        self.stats.executor_switches += 1

    # -- before the forward --------------------------------------------------------------
    def drafts(self, seqs: Seq[Sequence], requests: Seq[DraftRequest], strategy: Strategy) -> list[DraftTree]:
        """One draft per request (the step's ``seqs`` that draft): the branch kept for its sequence
        last step if it is still valid, else one drafted now (serially)."""
        self.stats.steps += 1
        self.stats.rounds += len(seqs)
        try:
            self.executor.refresh()
        except ExecutorError as e:
            self.fail(e)
        self._reconcile(seqs)
        ready = {seq.seq_id: self._ready.pop(seq.seq_id, None) for seq in seqs}
        trees: list[DraftTree | None] = []
        for request in requests:
            kept = ready[request.seq.seq_id]
            if kept is not None and kept[2] == strategy and kept[0] == request.seq.num_tokens:
                self.stats.ready += 1
                trees.append(kept[1])
            else:
                trees.append(None)
        missing = [i for i, t in enumerate(trees) if t is None]
        if missing:
            start = time.perf_counter()
            serial = self._propose([requests[i] for i in missing], strategy.shape)
            self.stats.serial_draft_s += time.perf_counter() - start
            for i, tree in zip(missing, serial):
                trees[i] = tree
                seq = requests[i].seq
                self._held[seq.seq_id] = _Held(seq.num_tokens, _kept_tokens(tree))
        return trees  # type: ignore[return-value]

    def _reconcile(self, seqs: Seq[Sequence]) -> None:
        """Truncate the drafter's state to where what it last drafted from agrees with the sequence."""
        for seq in seqs:
            held = self._held.get(seq.seq_id)
            if held is None:
                continue
            real = [seq.token_at(i) for i in range(held.start, seq.num_tokens)]
            agree = agreeing_prefix(held.tokens, real)
            if agree < min(len(held.tokens), len(real)):  # held tokens past the sequence's end wait
                self.drafter.truncate(seq.seq_id, held.start + agree)
                held.tokens = held.tokens[:agree]

    # -- beside the forward --------------------------------------------------------------
    @contextmanager
    def overlap(self, seqs: Seq[Sequence], trees: Seq[DraftTree], strategy: Strategy) -> Iterator[None]:
        """Within the block, the next forward (the verification of ``trees``, packed as
        ``pack_verify_batch`` lays them out) runs beside the drafting of the next round: the
        drafter's own continuation of each chain starts before it, the early exit's guesses
        (``k`` of them) at its early exit."""
        self._branches = []
        if self.failed:
            yield
            return
        continued = self._launch_continuations(seqs, trees, strategy) if strategy.shape.is_chain else set()
        k = strategy.branches
        if k == 0:
            yield
            return
        rows, owners, offset = [], [], 0
        for tree in trees:
            rows.extend(range(offset, offset + len(tree) + 1))
            owners.append(offset)
            offset += len(tree) + 1
        early_exit = self._exits.get(k)
        if early_exit is None:
            early_exit = self._exits[k] = EarlyExit(self._target, self.exit_layer, k)
        fork = self.drafter.forks_branches

        def launch(topk: list[list[int]]) -> None:
            self.stats.early_exits += 1
            requests = []
            for i, (seq, tree) in enumerate(zip(seqs, trees)):
                for assumed in plan_branches(tree, topk[owners[i] : owners[i] + len(tree) + 1], k):
                    view = BranchView(seq, assumed, fork=fork and i in continued)
                    depth = max_draft_depth(view, strategy.shape)
                    if depth > 0 and not seq.stop_ids.intersection(assumed):
                        requests.append(DraftRequest(view, depth))
                        self._branches.append(_Branch(i, assumed, held=not view.fork, call=1))
            self._start(requests, strategy.shape)

        with early_exit.tap(rows, launch):
            yield

    def _launch_continuations(self, seqs: Seq[Sequence], trees: Seq[DraftTree], strategy: Strategy) -> set[int]:
        """PEARL-style post-verify: assume each chain is accepted whole and let the drafter go on
        drafting past it, its own next token standing for the bonus token; a branch of its own."""
        requests, continued = [], set()
        for i, (seq, tree) in enumerate(zip(seqs, trees)):
            if not len(tree) or seq.stop_ids.intersection(tree.tokens):
                continue
            view = BranchView(seq, tree.tokens)
            depth = 1 + max_draft_depth(BranchView(seq, [*tree.tokens, 0]), strategy.shape)
            if depth > 1:
                requests.append(DraftRequest(view, depth))
                self._branches.append(_Branch(i, None, held=True))
                continued.add(i)
        self._start(requests, DraftShape(strategy.shape.depth + 1))
        return continued

    def _start(self, requests: list[DraftRequest], shape: DraftShape) -> None:
        if not requests:
            return
        self.stats.branches += len(requests)
        try:
            self.executor.start(requests, shape)
        except ExecutorError as e:
            self.fail(e)

    # -- after verification --------------------------------------------------------------
    def settle(self, seqs: Seq[Sequence], trees: Seq[DraftTree], verdicts: Seq, strategy: Strategy, bases) -> None:
        """Collect the branches, keep the ones whose assumed tokens the round emitted, and truncate
        the drafter's state to what is real. ``bases`` are the sequences' lengths before the round."""
        start = time.perf_counter()
        drafted: list[DraftTree] = []
        if self._branches:
            try:
                drafted = self.executor.finish()
            except ExecutorError as e:
                self.fail(e)
        self.stats.wait_s += time.perf_counter() - start
        forks = self.drafter.forks_branches
        held: dict[int, tuple[int, list[int], DraftTree]] = {}
        for branch, tree in zip(self._branches, drafted):
            i, seq = branch.index, seqs[branch.index]
            if branch.assumed is None:  # a continuation: its first token stands for the bonus token
                if not len(tree):
                    continue
                branch.assumed, tree = [*trees[i].tokens, tree.tokens[0]], _without_first(tree)
            emitted = [seq.token_at(p) for p in range(bases[i], seq.num_tokens)]
            if branch.assumed == emitted and not seq.done and len(tree):
                self._ready[seq.seq_id] = (seq.num_tokens, tree, strategy)
                if branch.continued:
                    self.stats.ready_continued += 1
            # what the drafter's state holds: a forking drafter's first unforked branch of the sequence,
            # another drafter's first-listed branch (drafted last) of its last call
            if branch.held and (i not in held or (not forks and held[i][0] < branch.call)):
                held[i] = (branch.call, branch.assumed, tree)
        for i, (_, assumed, tree) in held.items():
            self._held[seqs[i].seq_id] = _Held(bases[i], assumed + _kept_tokens(tree))
        self._branches = []
        self._reconcile([s for s in seqs if not s.done])
        if not self.failed:  # no branch is being drafted now: the draft thread's missed shapes
            self.drafter.capture_missed_graphs()

    def serial_step(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        """A serial step's drafts from this pipeline's drafter, with current weights. The step tells
        that drafter what was accepted, which leaves its state exact: nothing is left to reconcile
        for these sequences."""
        try:
            self.executor.refresh()
        except ExecutorError as e:
            self.fail(e)
        for request in requests:
            self._held.pop(request.seq.seq_id, None)
        return self._propose(requests, shape)

    def _propose(self, requests: Seq[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        """Drafts from the executor's drafter; from the in-process one if the executor fails meanwhile."""
        try:
            return self.drafter.propose(requests, shape)
        except ExecutorError as e:
            self.fail(e)
            return self.drafter.propose(requests, shape)

    def fail(self, error: Exception) -> None:
        """The executor failed: drop what it had drafted; a peer's host hands drafting back to
        the own executor, the own executor's failure makes drafting serial and in-process."""
        self.stats.executor_failures += 1
        self._branches = []
        self._ready.clear()
        if self.executor is not self._own:
            logger.warning("the peer draft host failed (%s); drafting on this engine's own executor again", error)
            self.executor.close()
            self.executor = self._own
            self._held.clear()
            return
        logger.warning("mirror drafting stopped (%s); drafting serially from now on", error)
        self._own_failed = True

    def release(self, seq_id: int) -> None:
        self._ready.pop(seq_id, None)
        self._held.pop(seq_id, None)

    def close(self) -> None:
        if self.executor is not self._own:
            self.executor.close()
        self._own.close()


def _without_first(chain: DraftTree) -> DraftTree:
    probs = chain.draft_probs[1:] if chain.draft_probs is not None else None
    return DraftTree.chain(chain.tokens[1:], probs)


def _kept_tokens(tree: DraftTree) -> list[int]:
    """Draft tokens whose K/V a chain drafter keeps (all but the last; a tree keeps none)."""
    return list(tree.tokens[:-1]) if len(tree) and tree.is_chain else []
