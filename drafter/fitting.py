"""What the offline fits of drafter parts share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def frozen(*modules: nn.Module) -> Iterator[None]:
    """Within the block, gradients flow through ``modules`` but never into their parameters
    (a fit trains a small part in front of a model's own norm or LM head)."""
    params = [(p, p.requires_grad) for m in modules for p in m.parameters()]
    for p, _ in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in params:
            p.requires_grad_(flag)
