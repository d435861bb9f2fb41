"""How long will a request's completion be? RL samples each prompt many times per rollout and
revisits it every epoch, so its siblings finished so far and its lengths in recent rollouts
predict it (Seer's context-aware scheduling, DAS's per-prompt history).

Ray-free and cheap: one dict of small deques keyed by the prompt's tokens.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


def prompt_key(prompt: Sequence[int]) -> tuple[int, ...]:
    return tuple(prompt)


@dataclass
class PredictionLog:
    """Predictions made when requests were dispatched, against the lengths they turned out to have."""

    pairs: list[tuple[float, int]] = field(default_factory=list)  # (predicted, actual)

    def add(self, predicted: float | None, actual: int) -> None:
        if predicted is not None:
            self.pairs.append((predicted, actual))

    @property
    def mean_rel_error(self) -> float:
        """Mean of |predicted - actual| / actual."""
        return sum(abs(p - a) / max(a, 1) for p, a in self.pairs) / len(self.pairs) if self.pairs else math.nan

    def rank_agreement(self) -> float:
        """Share of request pairs whose predicted order matches their real order (0.5 = chance)."""
        pairs = [(p, a) for p, a in self.pairs]
        agree = total = 0
        for i in range(len(pairs)):
            for j in range(i + 1, min(len(pairs), i + 200)):  # a window keeps it linear-ish on big logs
                (p1, a1), (p2, a2) = pairs[i], pairs[j]
                if a1 == a2 or p1 == p2:
                    continue
                total += 1
                agree += (p1 > p2) == (a1 > a2)
        return agree / total if total else math.nan


class LengthPredictor:
    """Per prompt: the completion lengths of its siblings finished in this rollout and of its
    samples in the last ``window`` rollouts; the prediction is their mean (None when neither is
    known: the scheduler then probes one sample of the group first).

    ``begin_rollout`` moves this rollout's lengths into the history. At most ``max_prompts``
    prompts are remembered (least recently seen forgotten first).
    """

    def __init__(self, window: int = 4, max_prompts: int = 100_000) -> None:
        if not (isinstance(window, int) and window >= 0):
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        self.window = window
        self.max_prompts = max_prompts
        self._history: OrderedDict[tuple[int, ...], deque[list[int]]] = OrderedDict()
        self._current: dict[tuple[int, ...], list[int]] = {}
        self.log = PredictionLog()

    def begin_rollout(self) -> None:
        for key, lengths in self._current.items():
            if self.window == 0:
                break
            rollouts = self._history.setdefault(key, deque(maxlen=self.window))
            rollouts.append(lengths)
            self._history.move_to_end(key)
        while len(self._history) > self.max_prompts:
            self._history.popitem(last=False)
        self._current = {}
        self.log = PredictionLog()

    def observe(self, prompt: Sequence[int], length: int, predicted: float | None = None) -> None:
        """A request of ``prompt`` finished with ``length`` tokens (``predicted`` at its dispatch)."""
        self._current.setdefault(prompt_key(prompt), []).append(int(length))
        self.log.add(predicted, int(length))

    def predict(self, prompt: Sequence[int]) -> float | None:
        key = prompt_key(prompt)
        known = [n for rollout in self._history.get(key, ()) for n in rollout] + self._current.get(key, [])
        return sum(known) / len(known) if known else None

    def siblings_seen(self, prompt: Sequence[int]) -> int:
        return len(self._current.get(prompt_key(prompt), []))

    def state_dict(self) -> dict:
        """JSON-serializable: the window and, per prompt (least recently seen first), its rollouts' lengths."""
        return {"window": self.window, "history": [[list(k), [list(r) for r in v]] for k, v in self._history.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state["window"])
        self._history = OrderedDict((tuple(k), deque(v, maxlen=self.window)) for k, v in state["history"])
