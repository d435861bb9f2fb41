"""Each stage of the GPU check in a child process of its own, forked from a driver that has
imported what the stages import.

A stage started as a fresh interpreter pays for importing torch, transformers and tailspec every
time (about 9 s a stage on a CI machine's CPU, seconds on a lent GPU's host, ten stages a run).
The driver imports them once, without touching CUDA, and forks a child per stage: the child still
has its own CUDA context, memory and process group, so a crash, a hang or a leak costs only that
stage, and a stage past its time is killed with everything it started.

A child forked after its parent initialised the CUDA driver cannot use CUDA. The driver asks
whether CUDA is there through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which leaves the driver
uninitialised), and a child that finds its fork poisoned anyway (an import that initialised CUDA)
replaces itself with a fresh interpreter running the same stage: slower, never wrong.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def ask_cuda_without_initialising_it() -> None:
    """Make ``torch.cuda.is_available()`` in this process use NVML, so forks stay usable."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def preload(modules: Sequence[str]) -> None:
    """Import ``modules`` here so that forked stages start with them; one that fails to import is
    left to its stage, which imports it again and logs the traceback."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # a stage's own failure, reported by that stage
            pass
    import torch

    if torch.cuda.is_initialized():  # a forked stage could not use CUDA: say why the run is slower
        logger.warning("CUDA was initialised while preloading; each stage will start a fresh interpreter")


def run_forked(run: Callable[[], None], fresh_command: list[str], log: Path, timeout_s: float) -> str | None:
    """``run()`` in a forked child whose output goes to ``log``; ``fresh_command`` is the same
    work as a new interpreter, for a child that cannot use CUDA after the fork. Returns None when
    the child ended on its own, else why it was stopped (past ``timeout_s``, it and every process
    it started are killed)."""
    child = multiprocessing.get_context("fork").Process(target=_child, args=(run, fresh_command, log), daemon=False)
    child.start()
    try:
        child.join(timeout_s)
        return f"killed after {timeout_s:g} s" if child.is_alive() else None
    finally:  # also on Ctrl-C in the driver: the child's group is not in the terminal's
        if child.is_alive():
            _kill_group(child.pid)
            child.join()


def _child(run: Callable[[], None], fresh_command: list[str], log: Path) -> None:
    os.setpgid(0, 0)  # its own group: killed as one with what it starts
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)  # the descriptors, so that the stage's own children write there too
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, errors="replace", closefd=False)  # wherever they pointed before
    sys.stderr = open(2, "w", buffering=1, errors="replace", closefd=False)
    import torch

    if torch.cuda._is_in_bad_fork():
        os.execv(sys.executable, fresh_command)
    try:
        run()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone, or not yet its own group's leader
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
