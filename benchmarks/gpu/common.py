"""What every stage of the GPU check shares: its size, its report, its time budget, its clock."""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...rollout.params import MirrorConfig, RolloutConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckSize:
    """How big each stage runs: ``full`` on a lent GPU, ``tiny`` in the CPU rehearsal."""

    name: str
    grown_hidden: int  # the deep policy (24 x 256) grown to this width ...
    grown_intermediate: int
    grown_layers: int  # ... and depth
    speed_batches: tuple[int, ...]
    spec_batches: tuple[int, ...]
    max_new_tokens: int
    long_tail_prompts: int
    chi_square_samples: int
    divergence_prompts: int
    kernel_quick: bool
    long_contexts: tuple[int, ...]  # the speed stage's batch-1 decode at these contexts (prompt + generation)
    big_policy: tuple[int, int, int]  # fast_path's second policy: (hidden, intermediate, layers) ...
    big_batches: tuple[int, ...]  # ... decoded at these batch sizes
    batch1_passes: int  # the speed stage's batch-1 contenders, timed in this many interleaved passes
    tail_passes: int  # ... and the long tail's (fresh prompts each pass), and `none` at the largest batch
    anatomy_passes: int = 3  # the speed stage's decode-step profiles, in this many interleaved passes ...
    anatomy_batches: tuple[int, ...] = (1, 16, 64)  # ... at these batch sizes
    fast_path_passes: int = 3  # fast_path's contenders, timed in this many interleaved passes
    # each engine's KV pool in the speed and selector stages, which keep an engine per contender (a
    # dozen): the engine's default at full size; the rehearsal's share 24 GB of host memory
    kv_cache_tokens: int = RolloutConfig.kv_cache_tokens

    @classmethod
    def of(cls, name: str) -> CheckSize:
        if name == "full":  # about 1.0B parameters, 28 layers of 1792 (head size 64 kept); the big
            # policy has Llama-3-8B's width, MLP and depth: 7.2B parameters
            return cls(
                "full", 1792, 4864, 28, (1, 16, 64, 256), (1, 16, 64), 128, 64, 5000, 32, False, (2048, 8192, 32768),
                (4096, 14336, 32), (1,), 5, 3,
            )  # fmt: skip
        if name == "tiny":
            # the rehearsal proves every part runs (CI runs it): the fewest passes, batches and tokens
            # that still take each path (interleaving, same-pass ratios, a batch above 1), on the
            # smallest policies that still grow (one layer deeper; the big one wider too)
            return cls(
                "tiny", 256, 768, 25, (1, 4), (1, 4), 8, 4, 600, 4, True, (128,), (384, 960, 26), (1,), 2, 2, 1,
                anatomy_batches=(1,), fast_path_passes=2, kv_cache_tokens=8192,
            )  # fmt: skip
        raise ValueError(f"size must be 'full' or 'tiny', got {name!r}")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def graph_backend() -> str:
    """Captured CUDA graphs on a GPU; the eager bucket backend (the same bookkeeping) in the rehearsal."""
    return "cuda_graph" if torch.cuda.is_available() else "eager"


def mirror_config() -> MirrorConfig:
    """Mirror drafts beside the target: on a second CUDA stream on a GPU, inline in the rehearsal."""
    return MirrorConfig(executor="stream" if torch.cuda.is_available() else "inline")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result and its wall seconds, the device synchronised on both sides."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


@dataclass
class StageReport:
    """One stage's results: named checks (pass/fail with a detail), measurements, what was skipped
    and why, and the traceback of anything that failed."""

    stage: str
    size: str
    device: str
    budget_s: float
    status: str = "running"
    seconds: float = 0.0
    checks: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    skipped: list[dict[str, str]] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    part_seconds: dict[str, float] = field(default_factory=dict)  # each part that ran: its wall seconds


class Stage:
    """A stage's report plus its soft deadline: parts check :meth:`left` before they start, so a
    stage that runs long drops its last parts (named as skipped) instead of the whole pack."""

    def __init__(self, name: str, size: CheckSize, budget_s: float, out: Path) -> None:
        self.report = StageReport(name, size.name, _device_name(), budget_s)
        self.size = size
        self.out = out
        self._start = time.perf_counter()
        self._deadline = self._start + budget_s

    def left(self) -> float:
        return self._deadline - time.perf_counter()

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.report.checks.append({"name": name, "passed": bool(passed), "detail": detail})
        logger.info("%s %s: %s %s", self.report.stage, name, "ok" if passed else "FAILED", detail)
        self.save()
        return bool(passed)

    def target(self, name: str, met: bool, detail: str = "") -> bool:
        """A speed target: a check on the GPU; in the CPU rehearsal (tiny size) only recorded, since
        a CPU at tiny sizes says nothing of it."""
        if self.size.name == "full":
            return self.check(name, met, detail)
        self.report.results.setdefault("targets (not judged at this size)", {})[name] = f"{met} {detail}".strip()
        self.save()
        return bool(met)

    def record(self, key: str, value: Any) -> None:
        self.report.results[key] = value
        self.save()

    def skip(self, name: str, why: str) -> None:
        self.report.skipped.append({"name": name, "why": why})
        logger.info("%s %s: skipped (%s)", self.report.stage, name, why)
        self.save()

    @contextmanager
    def part(self, name: str, needs_s: float = 0.0, cuda_only: bool = False) -> Iterator[bool]:
        """Run a part of the stage: yields False (and records the skip) when it cannot run now;
        an exception inside is recorded with its traceback and the stage goes on."""
        if cuda_only and not torch.cuda.is_available():
            self.skip(name, "needs CUDA")
            yield False
            return
        if self.left() < needs_s:
            self.skip(name, f"stage budget: {self.left():.0f} s left, needs about {needs_s:.0f} s")
            yield False
            return
        started = time.perf_counter()
        try:
            yield True
        except Exception as e:  # a failing part is a finding, not the end of the check
            self.report.errors.append({"part": name, "error": repr(e), "traceback": traceback.format_exc()})
            logger.exception("%s %s failed", self.report.stage, name)
        finally:
            self.report.part_seconds[name] = round(time.perf_counter() - started, 2)
            self.save()

    def finish(self) -> StageReport:
        r = self.report
        r.seconds = round(time.perf_counter() - self._start, 2)
        failed = r.errors or any(not c["passed"] for c in r.checks)
        r.status = "failed" if failed else ("partial" if r.skipped else "ok")
        self.save()
        return r

    def save(self) -> None:
        self.report.seconds = round(time.perf_counter() - self._start, 2)
        path = self.out / f"{self.report.stage}.json"
        path.write_text(json.dumps(asdict(self.report), indent=1, default=str) + "\n")


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
