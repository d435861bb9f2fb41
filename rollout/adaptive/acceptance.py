"""What each drafter's drafts are worth: tokens emitted per drafting sequence-step, by arm.

Verification tells, for every drafting sequence, how deep its draft went and how much of it was
accepted. For chains the accepted length's distribution is kept per drafter as a survival table:
``reached[j]`` sequence-steps drafted a j-th token after accepting the first j - 1, ``passed[j]``
accepted it. Every chain depth follows (``chain:2``'s worth is ``chain:4``'s, truncated), and a
step of any chain arm of the drafter teaches all of them. Trees, hybrids and suffix trees keep
their own counters (tokens emitted and drafting sequence-steps). A drafter's new version weighs
what its older versions taught down by a factor, softly, instead of dropping it; books of several
workers merge by averaging their counts (the estimates are the pooled ones, the evidence no larger
than one worker's, so a merge repeated every sync never counts a step twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..strategy import Strategy

PRIOR_HAZARD = 0.5  # a drafted token's acceptance before any evidence, weighted as one sequence-step


def prior_expected(depth: int) -> float:
    """Tokens a sequence-step emits before any evidence: every draft level accepted at ``PRIOR_HAZARD``."""
    return 1.0 + sum(PRIOR_HAZARD**j for j in range(1, depth + 1))


@dataclass
class ChainCounts:
    reached: list[float] = field(default_factory=list)  # index j - 1: drafted a j-th token, first j - 1 accepted
    passed: list[float] = field(default_factory=list)  # index j - 1: ... and accepted it

    def add(self, drafted: int, accepted: int) -> None:
        grow = drafted - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.passed += [0.0] * grow
        for j in range(min(drafted, accepted + 1)):
            self.reached[j] += 1
            self.passed[j] += j < accepted

    def expected(self, depth: int) -> float:
        """Tokens a sequence-step emits drafting a chain of ``depth``: 1 + sum of P(accepted >= j)."""
        total, survive = 1.0, 1.0
        for j in range(depth):
            reached = self.reached[j] if j < len(self.reached) else 0.0
            passed = self.passed[j] if j < len(self.passed) else 0.0
            survive *= (passed + PRIOR_HAZARD) / (reached + 1.0)
            total += survive
        return total

    @property
    def evidence(self) -> float:
        return self.reached[0] if self.reached else 0.0


@dataclass
class ArmCounts:
    emitted: float = 0.0  # tokens emitted by drafting sequence-steps
    steps: float = 0.0  # drafting sequence-steps

    def add(self, drafted: int, accepted: int) -> None:
        self.emitted += 1 + accepted
        self.steps += 1

    def expected(self, prior: float) -> float:
        """Tokens per drafting sequence-step, ``prior`` weighted as one sequence-step."""
        return (self.emitted + prior) / (self.steps + 1)

    @property
    def evidence(self) -> float:
        return self.steps


def _chain_key_of_tree(arm: Strategy) -> str | None:
    """The chain table a tree arm's first branch teaches (its drafter's), if any."""
    if arm.kind == "tree" or (arm.kind == "mirror" and not arm.shape.is_chain):
        return "chain-chain"
    return "suffix-chain" if arm.kind == "suffix" and not arm.shape.is_chain else None


def book_key(arm: Strategy) -> str:
    """Which counters ``arm``'s outcomes go to: its drafter's chain table, or its own."""
    if arm.kind == "chain" or (arm.kind == "suffix" and arm.shape.is_chain):
        return f"{arm.kind}-chain"
    return str(arm)


class AcceptanceBook:
    """Expected tokens per drafting sequence-step for every speculative arm (see the module doc)."""

    def __init__(self) -> None:
        self.counts: dict[str, ChainCounts | ArmCounts] = {}

    def _counts(self, arm: Strategy) -> ChainCounts | ArmCounts:
        key = book_key(arm)
        if key not in self.counts:
            self.counts[key] = ChainCounts() if key.endswith("-chain") else ArmCounts()
        return self.counts[key]

    def observe(
        self,
        arm: Strategy,
        drafted: list[int],
        accepted: list[int],
        branches: list[tuple[int, int]] | None = None,
    ) -> None:
        """One verified step: per sequence, the draft tokens it got verified and how many were kept,
        and (trees) its first branch's depth and kept length, which teach the drafter's chains."""
        counts = self._counts(arm)
        for d, a in zip(drafted, accepted):
            if d > 0:
                counts.add(d, a)
        chain_key = _chain_key_of_tree(arm)
        if branches is not None and chain_key is not None:
            chain = self.counts.setdefault(chain_key, ChainCounts())
            for d, a in branches:
                if d > 0:
                    chain.add(d, a)

    def expected(self, arm: Strategy, optimism: float = 0.0) -> float:
        """Tokens a drafting sequence-step of ``arm`` emits; with ``optimism``, moved towards the
        most it can emit (every draft level accepted) as if that were ``optimism`` more
        sequence-steps of evidence: an arm never drafted counts at its best, one drafted for a
        few dozen sequence-steps at little more than what it measured."""
        if not arm.speculative:
            return 1.0
        counts, depth = self._counts(arm), arm.shape.depth
        if isinstance(counts, ChainCounts):
            mean = counts.expected(depth)
        else:  # a tree's first branch is its drafter's chain: what that chain accepts is its prior
            chain = self.counts.get("chain-chain" if arm.uses_model_drafter else "suffix-chain")
            mean = counts.expected(chain.expected(depth) if isinstance(chain, ChainCounts) else prior_expected(depth))
        if optimism <= 0:
            return mean
        return mean + (1.0 + depth - mean) * optimism / (optimism + counts.evidence)

    def fade(self, uses_model: set[str], weight: float) -> None:
        """A drafter's new version: what the arms ``uses_model`` (book keys) measured counts ``weight`` x."""
        for key, counts in self.counts.items():
            if key in uses_model:
                for name, value in vars(counts).items():
                    setattr(counts, name, [x * weight for x in value] if isinstance(value, list) else value * weight)

    def state_dict(self) -> dict:
        return {key: vars(counts) for key, counts in self.counts.items()}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {
            key: (ChainCounts if key.endswith("-chain") else ArmCounts)(**{k: v for k, v in saved.items()})
            for key, saved in state.items()
        }

    @classmethod
    def merged(cls, states: list[dict]) -> dict:
        """The average of several books' states (workers' books at a policy sync)."""
        out: dict[str, dict] = {}
        for key in {k for state in states for k in state}:
            rows = [state[key] for state in states if key in state]
            merged: dict = {}
            for name in rows[0]:
                values = [row[name] for row in rows]
                if isinstance(values[0], list):
                    width = max(len(v) for v in values)
                    merged[name] = [sum(v[j] for v in values if j < len(v)) / len(states) for j in range(width)]
                else:
                    merged[name] = sum(values) / len(states)
            out[key] = merged
        return out
