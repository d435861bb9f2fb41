"""Speculation strategies and their string form (``RolloutConfig.strategy``, ``--strategy``).

=======================  ===========================================================
``none``                 plain decoding, one token per sequence per step
``chain:K``              the model drafter proposes a chain of K tokens (K in [1, 16])
``tree:D,K,B``           the model drafter proposes a tree: depth D in [1, 16], up to
                         K children per node in [1, 8], at most B nodes in [D, 128]
``suffix``               the suffix/n-gram drafter, default shape ``suffix:8,2,16``
``suffix:K``             the suffix drafter, as a chain of up to K tokens
``suffix:D,K,B``         the suffix drafter, as a tree with frequency-ranked branches
``hybrid``               the model drafter's tree and the suffix drafter's tree fused
                         into one verification tree, default ``hybrid:4,2,12``
``hybrid:D,K,B``         the same with depth D, K children per node, budget B nodes
``mirror:S,k=N``          Mirror-SD: the model drafter's ``S`` (``chain:K`` or ``tree:D,K,B``)
                         drafted serially when needed, and meanwhile the next round's draft
                         made beside the verification forward: the drafter's own continuation
                         of a chain, and N guesses from the target's early exit
                         (``rollout/mirror/pipeline.py``; N in [0, 4])
``adaptive``             a per-step choice among arms (``RolloutConfig.selector.arms``)
                         by measured goodput (:mod:`tailspec.rollout.adaptive.selector`)
=======================  ===========================================================

One strategy runs per batch step; the engine can switch between steps
(:meth:`tailspec.rollout.RolloutEngine.set_strategy`) without re-prefilling anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..draft_contract import DraftShape

KINDS = ("none", "chain", "tree", "suffix", "hybrid", "mirror", "adaptive")
GRAMMAR = (
    "'none', 'chain:K', 'tree:D,K,B', 'suffix', 'suffix:K', 'suffix:D,K,B', 'hybrid', 'hybrid:D,K,B', "
    "'mirror:chain:K,k=N', 'mirror:tree:D,K,B,k=N' or 'adaptive'"
)
MAX_MIRROR_BRANCHES = 4
DEFAULT_SUFFIX_SHAPE = DraftShape(depth=8, topk=2, budget=16)
DEFAULT_HYBRID_SHAPE = DraftShape(depth=4, topk=2, budget=12)
_DRAFTERS = {
    "none": frozenset(),
    "adaptive": frozenset(),
    "chain": frozenset({"model"}),
    "tree": frozenset({"model"}),
    "suffix": frozenset({"suffix"}),
    "hybrid": frozenset({"model", "suffix"}),
    "mirror": frozenset({"model"}),
}


@dataclass(frozen=True)
class Strategy:
    kind: str
    shape: DraftShape | None = None
    branches: int = 0  # mirror: early-exit candidates expanded into next-round drafts

    def __hash__(self) -> int:  # the selector keys its statistics by strategy: hash once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.kind, self.shape, self.branches))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def mirror(self) -> bool:
        return self.kind == "mirror"

    @cached_property  # the selector asks these of every arm at every step: computed once
    def speculative(self) -> bool:
        return self.kind not in ("none", "adaptive")

    @property
    def adaptive(self) -> bool:
        return self.kind == "adaptive"

    @property
    def drafters(self) -> frozenset[str]:
        """The drafters a step of this strategy runs: ``"model"`` and/or ``"suffix"``."""
        return _DRAFTERS[self.kind]

    @cached_property
    def uses_model_drafter(self) -> bool:
        return "model" in self.drafters

    @property
    def wants_model_drafter(self) -> bool:
        """Whether a model drafter should be supplied: a step of this strategy runs one, or
        (``adaptive``) it chooses per step among arms of which some run one. Without a drafter,
        ``adaptive`` keeps only the model-free arms."""
        return self.uses_model_drafter or self.adaptive

    @cached_property
    def max_draft_nodes(self) -> int:
        """The most draft tokens one sequence can get verified per step (0 without speculation)."""
        return self.shape.max_nodes if self.shape is not None else 0

    def __str__(self) -> str:
        cached = self.__dict__.get("_str")
        if cached is None:
            cached = self._spell()
            object.__setattr__(self, "_str", cached)
        return cached

    def _spell(self) -> str:
        if self.shape is None:
            return self.kind
        s = self.shape
        if self.kind == "mirror":
            chain = s.is_chain and s.max_nodes == s.depth
            base = f"chain:{s.depth}" if chain else f"tree:{s.depth},{s.topk},{s.max_nodes}"
            return f"mirror:{base},k={self.branches}"
        if self.kind == "chain" or (self.kind == "suffix" and s.is_chain and s.max_nodes == s.depth):
            return f"{self.kind}:{s.depth}"
        return f"{self.kind}:{s.depth},{s.topk},{s.max_nodes}"


def _ints(text: str, spec: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"strategy {spec!r} has a non-integer parameter; expected {GRAMMAR}") from None


def _check(name: str, value: int, lo: int, hi: int, spec: str) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"strategy {spec!r}: {name} must be in [{lo}, {hi}], got {value}")


def parse_strategy(spec: str | Strategy) -> Strategy:
    """Parse a strategy string; ``ValueError`` names what is wrong and the allowed forms."""
    if isinstance(spec, Strategy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"strategy must be a string ({GRAMMAR}), got {spec!r}")
    kind, _, params = spec.strip().partition(":")
    if kind == "mirror":
        return _parse_mirror(params, spec)
    if kind not in KINDS:
        raise ValueError(f"unknown strategy {spec!r}; expected {GRAMMAR}")
    if kind in ("none", "adaptive"):
        if params:
            raise ValueError(f"strategy {kind!r} takes no parameters, got {spec!r}")
        return Strategy(kind)
    if kind == "suffix" and not params:
        return Strategy("suffix", DEFAULT_SUFFIX_SHAPE)
    if kind == "hybrid" and not params:
        return Strategy("hybrid", DEFAULT_HYBRID_SHAPE)
    values = _ints(params, spec) if params else []
    if kind in ("chain", "suffix") and len(values) == 1:
        _check("K", values[0], 1, 16, spec)
        return Strategy(kind, DraftShape(depth=values[0], topk=1, budget=values[0]))
    if kind in ("tree", "suffix", "hybrid") and len(values) == 3:
        depth, topk, budget = values
        _check("depth D", depth, 1, 16, spec)
        _check("children per node K", topk, 1, 8, spec)
        _check("node budget B", budget, depth, 128, spec)
        return Strategy(kind, DraftShape(depth=depth, topk=topk, budget=budget))
    raise ValueError(f"strategy {spec!r} has the wrong number of parameters; expected {GRAMMAR}")


def _parse_mirror(params: str, spec: str) -> Strategy:
    base, sep, branches = params.rpartition(",k=")
    if not sep:
        raise ValueError(f"strategy {spec!r}: mirror needs its candidates as ',k=N'; expected {GRAMMAR}")
    k = _ints(branches, spec)
    if len(k) != 1:
        raise ValueError(f"strategy {spec!r}: k must be one integer; expected {GRAMMAR}")
    _check("candidates k", k[0], 0, MAX_MIRROR_BRANCHES, spec)
    inner = parse_strategy(base) if base.split(":")[0] in ("chain", "tree") else None
    if inner is None or not inner.uses_model_drafter:
        raise ValueError(f"strategy {spec!r}: mirror drafts with 'chain:K' or 'tree:D,K,B'; expected {GRAMMAR}")
    return Strategy("mirror", inner.shape, k[0])
