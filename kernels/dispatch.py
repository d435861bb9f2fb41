"""Which implementation of a kernel runs: on CUDA, Triton for verification and for decode and
verification attention in 16-bit dtypes; torch elsewhere.

The choice is made per call from the tensors' device (and, for attention, what the call suits), so
CUDA users get the faster kernel without configuration. ``auto`` follows what was measured on
GPUs (docs/GPU.md): the fused verification kernel is several times faster than the torch rule,
and the split-KV attention kernel faster than gather + SDPA in bf16 at every measured shape
(contexts 512 to 32k, batch 1 to 64, decode and 5-token verification). Attention stays on
torch for prefills (the per-head kernel for many new tokens is 3.5-11x slower than SDPA) and in
fp32 (the kernel is 3.5x slower there); ``triton`` still forces it.

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


def resolve_backend(
    device: torch.device, requested: str | None = None, kernel: str = "attention", *, triton_suits: bool = True
) -> Backend:
    """The backend a call of ``kernel`` on ``device`` uses (see the module docstring for the order).
    ``triton_suits``: whether the call is one ``auto`` gives Triton on CUDA (for attention: decode or
    verification in a 16-bit dtype, :func:`attention_suits_triton`); a forced ``triton`` ignores it."""
    levels = (requested, _forced.get().get(kernel), os.environ.get(ENV_VAR))
    name = next((c for c in levels if c not in (None, "auto")), "auto")
    check_backend_name(name, "kernel backend")
    if name == "auto":
        cuda = device.type == "cuda" and triton_installed()
        return "triton" if cuda and triton_suits else "torch"
    if name == "triton":
        if not triton_installed():
            raise RuntimeError("kernel backend 'triton' was requested but the triton package is not installed")
        if device.type != "cuda" and not triton_interpreter_on():
            raise RuntimeError(
                f"kernel backend 'triton' on {device.type} tensors needs Triton's interpreter: "
                "set TRITON_INTERPRET=1 before the first kernel runs"
            )
    return name  # type: ignore[return-value]


SPLIT_KV_MAX_NEW = 32  # new tokens per sequence up to which auto attention runs the split-KV kernel
AUTO_ATTENTION_DTYPES = frozenset({torch.bfloat16, torch.float16})


def attention_suits_triton(dtype: torch.dtype, max_new: int) -> bool:
    """Whether ``auto`` runs an attention call on Triton on CUDA: the split-KV kernel serves decode
    and verification (at most ``SPLIT_KV_MAX_NEW`` new tokens per sequence) in 16-bit dtypes."""
    return dtype in AUTO_ATTENTION_DTYPES and max_new <= SPLIT_KV_MAX_NEW
