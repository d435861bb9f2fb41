"""Stage ``gpu_tests``: every test marked ``gpu`` (they skip without CUDA; the rehearsal collects them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from .common import Stage

ROOT = Path(__file__).resolve().parents[2]


def gpu_test_files() -> list[str]:
    """Test files that hold a ``gpu``-marked test: only they are collected (the others may import
    the trainer stack, which the GPU image lacks)."""
    return sorted(str(p) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


def run(stage: Stage) -> None:
    files = gpu_test_files()
    stage.record("files", [str(Path(f).relative_to(ROOT)) for f in files])
    # -v: a line per test as it ends, so a run cut off at its budget still says what passed
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rs", *files]
    timeout = max(10, stage.left())
    try:
        out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired as cut:
        partial = _text(cut.stdout)
        ended = outcomes(partial)
        stage.record("pytest_tail", partial[-4000:] + _text(cut.stderr)[-2000:])
        stage.record("outcomes", ended)
        stage.check("gpu-marked tests", False, f"still running after {timeout:.0f} s: {_count(ended)}")
        return
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    stage.record("pytest_tail", tail)
    stage.record("outcomes", outcomes(out.stdout))
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", tail)}
    stage.record("counts", counts)
    if torch.cuda.is_available():
        stage.check("gpu-marked tests pass", out.returncode == 0 and counts.get("passed", 0) > 0, str(counts))
    else:  # exit 0: all collected and skipped for want of CUDA
        stage.check("gpu-marked tests collect (and skip without CUDA)", out.returncode == 0, str(counts))


def outcomes(verbose: str) -> dict[str, str]:
    """Each test's outcome from pytest's ``-v`` lines (``path::test PASSED [ 5%]``), in order."""
    found = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", verbose, re.M)
    return dict(found)


def _count(tests: dict[str, str]) -> str:
    kinds = sorted(set(tests.values()))
    return ", ".join(f"{sum(v == k for v in tests.values())} {k.lower()}" for k in kinds) or "no test ended"


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
