"""Keep the host's freed buffers in the process, so a CPU forward does not fault its memory in again.

glibc's allocator serves a large request (above its mmap threshold, 128 KiB at start) with a fresh
``mmap`` and gives it back to the system on free, and trims the heap's top once more than its trim
threshold is free. A CPU forward allocates and frees buffers of megabytes (activations, logits)
every step, so every step page-faults them in again: on the deep policy at batch 64 a (64, 1)
forward took 174-201 ms in a fresh process and 82-94 ms once a rollout's prefill had moved
glibc's thresholds up, and a plain rollout's forward 157 ms a step against 100 ms with the
thresholds raised up front. Calibration, timed before any rollout, priced every forward at about
twice a steady step's.

:func:`keep_freed_host_memory` raises both thresholds (``mallopt``) once per process, when an
engine on the CPU starts: buffers up to 32 MiB (glibc's largest mmap threshold) come from the heap,
and up to 1 GiB of freed heap is kept for reuse. It leaves the allocator alone off glibc, and where
the user set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (or ``MALLOC_ARENA_*`` tuning
through the environment: theirs wins).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: a larger request is always mmapped
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_applied: bool | None = None  # None: not tried yet in this process


def keep_freed_host_memory(device_type: str = "cpu") -> bool:
    """Raise glibc's mmap and trim thresholds for a CPU engine (once per process); whether they
    are raised now."""
    global _applied
    if device_type != "cpu":
        return bool(_applied)
    if _applied is None:
        _applied = _raise_thresholds()
    return _applied


def _raise_thresholds() -> bool:
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    logger.debug("glibc malloc thresholds raised for CPU forwards: %s", ok)
    return ok


def _glibc():
    """The C library if it is glibc (it has ``gnu_get_libc_version``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None
