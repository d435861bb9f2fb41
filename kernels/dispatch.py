"""Which implementation of a kernel runs: on CUDA, Triton for verification and torch for attention;
torch elsewhere.

The choice is made per call from the tensors' device, so CUDA users get the faster kernel without
configuration. ``auto`` follows what was measured on an H100 (docs/GPU.md): the fused verification
kernel is 9-12x faster than the torch rule, while the paged-attention kernel is 3.5-11x slower than
gather + SDPA in bf16 at 1-4k contexts (1.4x faster only in fp32), so attention stays on torch
until the kernel is tuned; ``triton`` still forces it.

It can be overridden, most specific first: a ``backend=`` argument, then the
:func:`kernel_backend` context manager (innermost first; the engine enters one with
``RolloutConfig.kernels``), then the ``TAILSPEC_KERNELS`` environment variable (``auto``,
``torch`` or ``triton``). ``auto`` at any level defers to the next.

Forcing ``triton`` on CPU tensors needs Triton's interpreter: ``TRITON_INTERPRET=1`` must be set
before the first kernel is compiled (the test suite does this when there is no CUDA device). The
Triton sources live in ``kernels/_triton_*.py`` and are imported only when first used, so
tailspec works without Triton installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

import torch

Backend = Literal["torch", "triton"]
BACKEND_CHOICES = ("auto", "torch", "triton")
KERNELS = ("attention", "verify")
AUTO_TRITON_ON_CUDA = frozenset({"verify"})  # what "auto" runs on Triton on CUDA (see the module docstring)
ENV_VAR = "TAILSPEC_KERNELS"

_forced: ContextVar[dict[str, str]] = ContextVar("tailspec_kernel_backend", default={})  # noqa: B039 (never mutated)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_backend_name(name: str, field: str = "backend") -> str:
    if name not in BACKEND_CHOICES:
        raise ValueError(f"{field} must be one of {BACKEND_CHOICES}, got {name!r}")
    return name


@contextmanager
def kernel_backend(name: str, kernels: tuple[str, ...] = KERNELS) -> Iterator[None]:
    """Use ``name`` (``auto``, ``torch`` or ``triton``) for the named kernels (default: all) in the block."""
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise ValueError(f"kernels must be a subset of {KERNELS}, got {unknown}")
    check_backend_name(name)
    chosen = {} if name == "auto" else {k: name for k in kernels}  # auto defers to the enclosing choice
    token = _forced.set({**_forced.get(), **chosen})
    try:
        yield
    finally:
        _forced.reset(token)


def resolve_backend(device: torch.device, requested: str | None = None, kernel: str = "attention") -> Backend:
    """The backend a call of ``kernel`` on ``device`` uses (see the module docstring for the order)."""
    levels = (requested, _forced.get().get(kernel), os.environ.get(ENV_VAR))
    name = next((c for c in levels if c not in (None, "auto")), "auto")
    check_backend_name(name, "kernel backend")
    if name == "auto":
        cuda = device.type == "cuda" and triton_installed()
        return "triton" if cuda and kernel in AUTO_TRITON_ON_CUDA else "torch"
    if name == "triton":
        if not triton_installed():
            raise RuntimeError("kernel backend 'triton' was requested but the triton package is not installed")
        if device.type != "cuda" and not triton_interpreter_on():
            raise RuntimeError(
                f"kernel backend 'triton' on {device.type} tensors needs Triton's interpreter: "
                "set TRITON_INTERPRET=1 before the first kernel runs"
            )
    return name  # type: ignore[return-value]
