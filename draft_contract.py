"""The contract between the engine and its drafters, at the bottom of the package.

A drafter proposes, for each running sequence, a :class:`DraftTree` rooted at the sequence's
last emitted token (not yet in the target's KV cache). A chain is a tree in which every node has
one child. Node ``i`` was drawn from ``draft_probs[i]`` (the drafter's processed distribution at
its parent) when the drafter samples, or chosen deterministically (``draft_probs is None``: the
verifier treats each node as a one-hot draft, which is exact for any deterministic rule, e.g.
top-k children or n-gram lookups). Verification (``tailspec.rollout.spec.verify``) makes the output
distribution exactly the target's whatever the drafter proposes; drafters only affect speed.

``rollout/`` depends on this module and on nothing in ``drafter/``: the engine gets its drafters
(a user's HF model or EAGLE-3 head made into one, the built-in suffix drafter, their hybrid) from
a :data:`DrafterFactory`, by default ``tailspec.drafter.factory.build_drafters``, which is looked
up by name the first time an engine needs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cache, cached_property
from importlib import import_module
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


def observed_rows(observed: Sequence[tuple[Any, int, list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """The rows of every sequence of a forward's ``observed`` (:meth:`Drafter.observe_batch`), in
    order: its kept tokens' rows of the features, and its rows of the logits after them."""
    rows = [row for _, _, seq_rows, _ in observed for row in seq_rows]
    logit_rows = [row for _, _, _, seq_logit_rows in observed for row in seq_logit_rows]
    return rows, logit_rows


@dataclass
class DraftTree:
    """Draft tokens for one sequence, in topological order (a parent precedes its children).

    ``parents[i]`` is the index of node ``i``'s parent, or -1 for a child of the root (the
    sequence's last emitted token). Siblings are tried in index order, so a drafter lists the
    more likely branch first.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [num_nodes, vocab] or None = deterministic

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree node {i} has parent {p}; parents must precede children (or be -1)")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError(
                f"draft_probs has {self.draft_probs.shape[0]} rows for a draft tree of {len(self.tokens)} nodes"
            )

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @cached_property
    def children(self) -> list[list[int]]:
        """``children[0]`` are the root's children, ``children[i + 1]`` node ``i``'s, in sibling order."""
        out: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def first_branch(self, path: Sequence[int]) -> tuple[int, int]:
        """How deep the first branch goes (the first child at every level: what this tree's
        drafter's chain would have drafted) and how much of it the accepted ``path`` (node
        indices) kept: what ``adaptive`` learns its drafter's chains from."""
        branch, node = [], -1
        while kids := self.children[node + 1]:
            node = kids[0]
            branch.append(node)
        kept = 0
        while kept < min(len(branch), len(path)) and branch[kept] == path[kept]:
            kept += 1
        return len(branch), kept

    def ancestor_mask(self) -> torch.Tensor:
        """``[n + 1, n + 1]`` bool mask over the root and the nodes: True where the row may attend.
        Built in numpy (a row copy per node: torch's per-element indexing costs ~10x more, and a
        tree step builds one per sequence and draft level)."""
        n = len(self.tokens)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return torch.from_numpy(mask)

    def truncated(self, num_nodes: int) -> DraftTree:
        """The first ``num_nodes`` nodes (still a valid tree, since parents precede children)."""
        if num_nodes >= len(self.tokens):
            return self
        probs = self.draft_probs[:num_nodes] if self.draft_probs is not None else None
        return DraftTree(self.tokens[:num_nodes], self.parents[:num_nodes], probs)


EMPTY_DRAFT = DraftTree()


@dataclass(frozen=True)
class DraftShape:
    """How many tokens to propose: ``depth`` levels, up to ``topk`` children per node, ``budget`` nodes.

    A chain is ``topk == 1`` and ``budget == depth``.
    """

    depth: int
    topk: int = 1
    budget: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.depth, int) and 1 <= self.depth <= 64):
            raise ValueError(f"draft depth must be an int in [1, 64], got {self.depth!r}")
        if not (isinstance(self.topk, int) and 1 <= self.topk <= 16):
            raise ValueError(f"draft topk must be an int in [1, 16], got {self.topk!r}")
        if self.budget is not None and not (isinstance(self.budget, int) and self.depth <= self.budget <= 512):
            raise ValueError(f"draft budget must be an int in [depth={self.depth}, 512], got {self.budget!r}")

    @property
    def max_nodes(self) -> int:
        return self.budget if self.budget is not None else self.depth * self.topk

    @property
    def is_chain(self) -> bool:
        return self.topk == 1


class SequenceView(Protocol):
    """What a drafter may read of a running sequence (the engine's ``Sequence`` satisfies it).
    Drafters never change a sequence; the engine appends the tokens verification keeps."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    group: int | None
    stop_ids: frozenset[int]
    params: Any  # the request's SamplingParams

    @property
    def num_tokens(self) -> int: ...

    def token_at(self, position: int) -> int: ...


class BranchView:
    """A sequence as it would stand if this round kept ``extra`` (drafted tokens assumed accepted,
    then the assumed correction or bonus token): what a drafter drafts the next round from while the
    target is still verifying this one (Mirror-SD, ``rollout/mirror/pipeline.py``). Draws for its drafts come
    from the drafter's own stream (``generator`` is None), never the request's."""

    generator = None

    def __init__(self, seq: SequenceView, extra: Sequence[int], fork: bool = False) -> None:
        self.seq = seq
        self.extra = list(extra)
        self.fork = fork  # draft it in a fork, leaving the drafter's state of the sequence as it is
        self.seq_id = seq.seq_id
        self.prompt_ids = seq.prompt_ids
        self.group = seq.group
        self.stop_ids = seq.stop_ids
        self.params = seq.params
        self._base = seq.num_tokens

    @property
    def output_ids(self) -> list[int]:
        return list(self.seq.output_ids) + self.extra

    @property
    def num_tokens(self) -> int:
        return self._base + len(self.extra)

    def token_at(self, position: int) -> int:
        return self.seq.token_at(position) if position < self._base else self.extra[position - self._base]


@dataclass
class DraftRequest:
    """One sequence to draft for this step, with its limit: no node deeper than ``max_depth``."""

    seq: SequenceView
    max_depth: int


class DraftStep(ABC):
    """One speculative step as the drafter its strategy names sees it (the engine's, in
    ``rollout/spec/draft_step.py``): the draft's ``shape``, the engine's ``strategy``, and the state to
    draft from, which the drafter picks by what it asks for.

    * :meth:`on_device`: the device's state, never read: the step is launched before the step in
      flight is committed, and the host assumes that step accepted every draft (room is reserved
      for it). A drafter that drafts on the device asks for it first and returns
      :class:`DeviceDrafts`; None where the batch cannot be launched from there.
    * :meth:`on_host`: the host's text, exact: the step in flight is committed first. A drafter
      that drafts from text (the suffix drafter, the hybrid, mirror steps) returns one tree per
      request; the cost is the device idling while the host drafts, verifies and commits.
    """

    seqs: list[SequenceView]  # the step's sequences; once on_host committed the step before, those still running
    shape: DraftShape
    tree: bool  # the step verifies trees (else chains)
    strategy: Any  # the engine's Strategy; a drafter that runs another (a failed mirror's serial one) sets it

    @abstractmethod
    def on_device(
        self, reserve: Callable[[Sequence[SequenceView], Sequence[int], bool], bool]
    ) -> DeviceDraftInputs | None:
        """The device's state for every sequence of the step, room taken for a fully accepted step;
        ``reserve(seqs, lengths, from_host)``: the drafter's room for each sequence's first
        ``lengths[i]`` tokens in its own state, False where it has none or (``from_host``: nothing
        in flight) cannot draft for them from the host's state. None: draft :meth:`on_host`."""

    @abstractmethod
    def on_host(self) -> list[DraftRequest]:
        """The step in flight committed, a request for each sequence that drafts this step (with
        its depth limit), in batch order; empty where none does."""


@dataclass
class DeviceDrafts:
    """Drafts on the device for :meth:`DraftStep.on_device`'s sequences: ``tokens`` ``[B, n]``; a
    tree's ``parents`` (node indices, -1 for a child of the root; a best-first tree with the same
    ``n`` for every row, ``drafter/tree_search.grow_static_trees``, verified as one-hot nodes), None
    for chains; a chain's draft distributions ``[B, n, vocab]``, which a batch with a sampling row
    must give (verification reads them; a deterministic chain gives one-hot rows), None only where
    every row is greedy."""

    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class Settled:
    """What the host read of a step a drafter drafted for one sequence: ``kept`` drafts (from the
    host's text: the accepted path's length; from the device's state: those its forwards left at
    their positions, a chain's accepted ones and none of a tree's), and for a step launched from
    the device's state the pending token's position it ran at (``cached``, None otherwise) and
    whether a step launched since drafted from it (``consumed``)."""

    kept: int
    cached: int | None = None
    consumed: bool = False


class Drafter(ABC):
    """What the engine asks of a drafter: seven methods, :meth:`draft` the only one without a default.

    Per speculative step the engine calls :meth:`draft` (the one way to draft: the drafter reads the
    step's state where it chooses, :class:`DraftStep`), then :meth:`settled` for each sequence once the
    step is read. After every target forward a drafter with ``feature_layers`` gets
    :meth:`observe_batch`; :meth:`finished` and :meth:`release` when a sequence ends; :meth:`bind`
    and :meth:`fit_problems` when it meets a target. Drafters may keep per-sequence state keyed by
    ``seq.seq_id``. What only some drafters do is declared as a capability below.
    """

    name: str = "drafter"
    #: target layers whose *inputs* this drafter reads (EAGLE-style heads); ``None`` = none. When
    #: set, the engine taps them in every target forward and calls :meth:`observe_batch`.
    feature_layers: tuple[int, ...] | None = None

    def bind(self, vocab_size: int, tokenizer=None) -> None:  # noqa: B027 - optional hook
        """Check that the drafter can serve a target with this vocabulary; raise ValueError if not."""

    def fit_problems(self, target: Any, tokenizer: Any = None) -> list[str]:
        """What keeps this drafter from drafting for ``target`` (a Hugging Face causal LM) as it is
        now: checked at every policy sync, since a policy can change shape under a bound drafter
        (resized embeddings). Empty when it fits; the default checks nothing."""
        return []

    @abstractmethod
    def draft(self, step: DraftStep) -> list[DraftTree] | DeviceDrafts:
        """The step's drafts: one tree per request of ``step.on_host()`` (each within the step's shape
        and the request's ``max_depth``, possibly empty), or :class:`DeviceDrafts` for the sequences of
        ``step.on_device(...)``."""

    def settled(self, seq: SequenceView, settled: Settled) -> None:  # noqa: B027 - optional hook
        """What the verification kept of the draft it made for ``seq`` in the step just read."""

    def observe_batch(  # noqa: B027 - optional hook
        self,
        observed: Sequence[tuple[SequenceView, int, list[int], list[int]]],
        features: torch.Tensor,
        logits: torch.Tensor,
    ) -> None:
        """One target forward's observations: per sequence ``(seq, start, rows, logit_rows)``, the
        packed rows of ``features`` of its committed tokens at positions ``start, start + 1, ...``
        and the rows of ``logits`` after them (the distributions their next tokens were drawn from;
        :func:`observed_rows` gathers them). Called for drafters with ``feature_layers``, after
        every target forward, for tokens the sequence keeps; a plain step launched before the step
        before it was committed may also hand over the row of a token past the sequence's last
        (computed before its stop was read): its ``finished`` and ``release`` follow, and what the
        drafter records must be cut to the sequence's tokens."""

    def finished(self, seq: SequenceView) -> None:  # noqa: B027 - optional hook
        """``seq`` finished normally (its completion may be remembered); ``release`` follows."""

    def release(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """Forget per-sequence state (the sequence finished, was aborted or handed over)."""


@runtime_checkable
class DraftsFromText(Protocol):
    """A drafter that drafts from the host's text for any caller: what the hybrid fuses, what a
    mirror step drafts serially with, what a draft process's copy answers."""

    def propose(self, requests: Sequence[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        """One draft tree per request (possibly empty), each within ``shape`` and ``max_depth``."""
        ...


def draft_from_text(drafter: DraftsFromText, step: DraftStep) -> list[DraftTree]:
    """``step`` drafted from the host's text, the step in flight committed first: how a drafter that
    only drafts from text implements :meth:`Drafter.draft`."""
    requests = step.on_host()
    return drafter.propose(requests, step.shape) if requests else []


@runtime_checkable
class DraftsBranches(DraftsFromText, Protocol):
    """A drafter mirror steps run on (``rollout/mirror/``): it drafts *branches* (requests whose
    sequence is a :class:`BranchView`) while the target verifies, and cuts its state back to where
    a branch agrees with the real text. ``forks_branches``: whether it drafts further branches (and
    every ``BranchView.fork``) in forks of a sequence's state, leaving the state with the sequence's
    first unforked branch (:func:`propose_slot_by_slot` is the way without forks)."""

    forks_branches: bool

    def propose_branches(self, requests: Sequence[DraftRequest], shape: DraftShape) -> list[DraftTree]:
        """One draft per :class:`BranchView` request, drafted while the target verifies."""
        ...

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Only the sequence's first ``num_tokens`` tokens are what this drafter last saw (it drafted
        from a branch that was not kept): forget any state past them."""
        ...

    def capture_missed_graphs(self) -> None:
        """Capture the graph buckets a draft executor's thread ran without one (nothing without a
        graph pool). Called on the engine's thread while no draft thread runs."""
        ...


def propose_slot_by_slot(
    drafter: DraftsBranches, requests: Sequence[DraftRequest], shape: DraftShape
) -> list[DraftTree]:
    """Branches one round per branch slot (a sequence appears at most once in a :meth:`propose`
    call), the sequence's first-listed branch last, so that a drafter whose state follows its last
    proposal then holds the likeliest branch; between a sequence's rounds its state is truncated to
    what the two branches share. A drafter without forks may answer ``propose_branches`` with it."""
    rounds: list[list[int]] = []
    seen: dict[int, int] = {}
    for i in reversed(range(len(requests))):
        slot = seen.get(requests[i].seq.seq_id, 0)
        seen[requests[i].seq.seq_id] = slot + 1
        if slot == len(rounds):
            rounds.append([])
        rounds[slot].append(i)
    out: list[DraftTree] = [EMPTY_DRAFT] * len(requests)
    previous: dict[int, list[int]] = {}  # seq_id -> the tokens past the sequence its last round drafted from
    for slot in rounds:
        for i in slot:
            view = requests[i].seq
            before = previous.get(view.seq_id)
            if before is not None:
                shared = next((n for n, (a, b) in enumerate(zip(before, view.extra)) if a != b), None)
                common = min(len(before), len(view.extra)) if shared is None else shared
                drafter.truncate(view.seq_id, view.seq.num_tokens + common)
        for i, tree in zip(slot, drafter.propose([requests[i] for i in slot], shape)):
            out[i] = tree
            previous[requests[i].seq.seq_id] = requests[i].seq.extra + list(tree.tokens)
    return out


# -- optional capabilities: declared by the drafters that have them, checked with isinstance ---------


@runtime_checkable
class Versioned(Protocol):
    """A drafter whose weights change during a run (trained online): ``version`` moves at every change."""

    @property
    def version(self) -> int: ...


@runtime_checkable
class Portable(Protocol):
    """A drafter a copy of which can draft in another process (a Mirror-SD draft process, a peer's
    draft host): a picklable builder of a fresh copy, the module whose weights that copy follows,
    and the loading of those weights into a copy."""

    def rebuild(self) -> Callable[[], Drafter]: ...

    def shipped_weights(self) -> torch.nn.Module: ...

    def load_weights(self, data: bytes) -> None: ...


@runtime_checkable
class TimesDraftLevels(Protocol):
    """A model drafter that can time one of its draft levels before it drafts: what ``adaptive``
    prices its arms' drafting from until their steps measure it (``rollout/adaptive/choice.py``)."""

    def draft_level_seconds(self, n: int, repeats: int) -> float | None:
        """Seconds of one draft forward over ``n`` sequences, one token each at a short context, on
        scratch state (the median of ``repeats`` runs after a first, untimed one); None when its
        cache has no room to time one."""
        ...


@runtime_checkable
class Stateful(Protocol):
    """A drafter with learned state worth a checkpoint (the suffix drafter's history)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class StepOnDevice:
    """A step as its verification left it on the device (``rollout/spec/device_step.py``): the
    pending tokens' positions it ran at, its emitted tokens (``emitted[:, j]`` is the token at
    ``cached + 1 + j``; ``accepted`` drafts then the final token are real, the rest padding), its
    accept lengths, the target's features at the rows of its pending token and its drafts (a
    tree's: at its accepted path's, then padding) for a drafter that reads them (None otherwise),
    and whether its drafts were a tree (whose drafter forwards wrote scratch, not the kept
    tokens, past the pending one)."""

    cached: torch.Tensor  # [B]
    emitted: torch.Tensor  # [B, depth + 1]
    accepted: torch.Tensor  # [B]
    features: torch.Tensor | None = None  # [B, depth + 1, feature_size]
    tree: bool = False


@dataclass
class DeviceDraftInputs:
    """What a step launched on the device drafts from, every tensor on the device, never read:
    each sequence's pending token's position (``cached``), its tokens at ``cached - 1`` and
    ``cached`` (``last_two``), and the step before it (None when the step is launched from the
    host's state, which is exact then); the sequences (the batch's rows), and ``bound``, an upper
    bound of every position the drafter's forwards or the verification write, plus one."""

    cached: torch.Tensor  # [B]
    last_two: torch.Tensor  # [B, 2]
    previous: StepOnDevice | None = None
    seqs: list[SequenceView] = field(default_factory=list)
    bound: int = 0


def static_tree_nodes(shape: DraftShape) -> int:
    """How many nodes a tree of ``shape`` drafted on the device has (the same for every sequence):
    the ``budget`` best of level 1's ``topk`` and each further level's ``topk ** 2``."""
    return min(shape.max_nodes, shape.topk + (shape.depth - 1) * shape.topk**2)


def static_tree_scratch(shape: DraftShape) -> int:
    """The most rows past the pending token a drafter's forward writes growing a tree of ``shape``
    on the device (its last level runs ``topk`` paths of ``depth - 1`` tokens)."""
    return shape.topk * (shape.depth - 1)


ChainOnDevice = Callable[[DeviceDraftInputs, int], tuple[torch.Tensor, torch.Tensor | None]]
TreeOnDevice = Callable[[DeviceDraftInputs, DraftShape], tuple[torch.Tensor, torch.Tensor]]


def draft_on_device_else_text(
    step: DraftStep,
    reserve: Callable[[Sequence[SequenceView], Sequence[int], bool], bool],
    chain: ChainOnDevice,
    tree: TreeOnDevice,
    propose: Callable[[Sequence[DraftRequest], DraftShape], list[DraftTree]],
) -> list[DraftTree] | DeviceDrafts:
    """:meth:`Drafter.draft` for a drafter that drafts on the device where the step lets it and from
    the host's text otherwise: ``chain(inputs, depth)`` gives ``[B, depth]`` tokens, each picked by
    its request's rule, and their draft distributions (None for an all-greedy batch);
    ``tree(inputs, shape)`` a best-first tree's tokens and parents ``[B, n]``
    (:func:`static_tree_nodes`)."""
    inputs = step.on_device(reserve)
    if inputs is None:
        requests = step.on_host()
        return propose(requests, step.shape) if requests else []
    if step.tree:
        tokens, parents = tree(inputs, step.shape)
        return DeviceDrafts(tokens, parents)
    tokens, probs = chain(inputs, step.shape.depth)
    return DeviceDrafts(tokens, None, probs)


@runtime_checkable
class DraftsWholeSteps(Protocol):
    """A drafter that runs a step's drafting whole (Mirror-SD, ``rollout/mirror/drafter.py``): beside
    :meth:`Drafter.draft` it drafts during the step's verification forward and settles what that kept
    for the whole batch; the engine asks it which strategies' steps it takes, and tells it the arms
    it may run. ``strategy`` is the engine's ``Strategy``, ``seqs`` its running sequences."""

    def takes(self, strategy: Any) -> bool: ...

    def beside_verify(self, seqs: Sequence[Any], trees: Sequence[DraftTree], strategy: Any) -> AbstractContextManager:
        """Entered around the step's verification forward."""
        ...

    def settle(self, seqs: Sequence[Any], trees: Sequence[DraftTree], verdicts: Sequence[Any], strategy: Any, bases):
        """What the verification kept (``bases``: each sequence's tokens before the step); in place
        of :meth:`Drafter.settled`."""
        ...

    def prepare(self, arms: Sequence[Any]) -> None:
        """The engine's strategy (and its arms) changed: refuse what it cannot run, start what they need."""
        ...

    def close(self) -> None: ...


@cache
def runs_whole_steps(drafter_type: type) -> bool:
    """Whether drafters of this type declare :class:`DraftsWholeSteps`, decided once per type (a
    runtime protocol's ``isinstance`` walks its members at every call, and steps ask every step)."""
    return issubclass(drafter_type, DraftsWholeSteps)


@dataclass
class DrafterSet:
    """The drafters one engine speculates with: the model drafter (None without one), the
    model-free suffix drafter, their hybrid, and the model drafter's mirror steps (both None
    without a model drafter)."""

    model: Drafter | None
    suffix: Drafter
    hybrid: Drafter | None
    mirror: Drafter | None = None  # a DraftsWholeSteps drafter

    def drafter_for(self, strategy: Any) -> Drafter | None:
        """The drafter a step of ``strategy`` (a speculative ``Strategy``) drafts with: a drafter that
        runs whole steps where it takes them, else the one its kind names."""
        if self.mirror is not None and runs_whole_steps(type(self.mirror)) and self.mirror.takes(strategy):
            return self.mirror
        if strategy.kind == "suffix":
            return self.suffix
        return self.hybrid if strategy.kind == "hybrid" else self.model

    def notified(self) -> list[Drafter]:
        """The drafters told of finished and released sequences (the hybrid's parts are told themselves)."""
        return [d for d in (self.model, self.suffix, self.mirror) if d is not None]


#: ``(user_drafter, target_model, rollout_config, vocab_size, tokenizer) -> DrafterSet``
DrafterFactory = Callable[[Any, torch.nn.Module, Any, int, Any], DrafterSet]

DEFAULT_DRAFTER_FACTORY = "tailspec.drafter.factory:build_drafters"


@cache
def drafter_factory(path: str = DEFAULT_DRAFTER_FACTORY) -> DrafterFactory:
    """The factory named ``module:function`` (imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)
