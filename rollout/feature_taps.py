"""The target features an EAGLE-style drafter reads: the hidden states entering a few decoder layers,
tapped in every forward whatever the strategy (so switching to the drafter never needs a
re-prefill), and handed over for the tokens a step keeps. One gather each for the whole batch (no
per-sequence index tensors or device copies); nothing is tapped for drafters that read none."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .model.runner import ModelRunner
from .prefill import Observed

# (observed, features, logits): what the drafters reading the features are handed
Observer = Callable[[list[Observed], torch.Tensor, torch.Tensor], None]


class FeatureTaps:
    def __init__(self, runner: ModelRunner, layers: Sequence[int] | None, observer: Observer) -> None:
        self.runner, self.layers, self.observer = runner, layers, observer
        self.last: torch.Tensor | None = None  # the last forward's taps, [T, feature_size]

    def forward(self, slices, tokens: list[int], positions: list[int], logits_index: list[int]) -> torch.Tensor:
        """The runner's forward, tapping the features when a drafter reads them."""
        if not self.layers:
            return self.runner.forward(slices, tokens, positions, logits_index)
        logits, self.last = self.runner.forward_with_features(slices, tokens, positions, logits_index, self.layers)
        return logits

    def observe(self, observed: list[Observed], logits: torch.Tensor) -> None:
        """Hand the observer, for each ``(seq, start, rows, logit_rows)``, the last forward's features
        of ``seq``'s kept tokens (packed ``rows``) and the logits after the last of them
        (``logit_rows`` of ``logits``)."""
        if self.layers and self.last is not None and observed:
            self.observer(observed, self.last, logits)
