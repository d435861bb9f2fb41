"""Mirror-SD as a drafter (strategy ``mirror:S,k=N``): a model drafter whose drafting runs beside the
target's verification forward, on an executor of its own (``executors.py``), through the
:class:`MirrorPipeline` it starts at its first step (or when the engine's arms include a mirror one).

The engine knows it only as a drafter that runs whole steps (:class:`~tailspec.draft_contract.DraftsWholeSteps`):
it drafts a step, wraps the step's forward, and settles what the verification kept. What is the
mirror's own stays here: the pipeline's life, the executor it drafts on and the switch to a
peer's draft host (:meth:`use_executor`, safe from any thread, taken at its next step).

While its pipeline runs it also drafts the engine's chain and tree steps (:meth:`takes`), on the
same executor's drafter: serial and mirror steps then share one drafter state, so an adaptive engine
switching between ``chain:4`` and ``mirror:chain:4`` does not catch a second copy of the drafter up on
every token the other one drafted (``hybrid`` keeps the in-process drafter its fusion wraps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager

import torch

from ...draft_contract import Drafter, DrafterSet, DraftsBranches, DraftStep, DraftTree, Portable, Settled
from ..model.early_exit import check_exit_layer
from ..model.layer_taps import decoder_layers
from ..model.runner import model_device_dtype
from ..params import EXECUTORS, MirrorConfig
from ..request import Sequence
from ..strategy import Strategy
from .executors import DraftExecutor, ExecutorError, InlineExecutor, ThreadExecutor
from .hosted import RayExecutor
from .pipeline import MirrorPipeline
from .process_executor import ProcessExecutor


class MirrorDrafter(Drafter):
    """Mirror steps of ``drafter`` (the engine's model drafter; mirror arms need it to declare
    ``DraftsBranches``, :meth:`prepare` refuses them otherwise) beside ``target``."""

    name = "mirror"

    def __init__(
        self, drafter: Drafter, target: torch.nn.Module, config: MirrorConfig | None = None, kernels: str = "auto"
    ) -> None:
        self.inner, self.target = drafter, target
        self.config = config or MirrorConfig()
        self.kernels = kernels  # RolloutConfig.kernels, for a draft process or actor
        self.pipeline: MirrorPipeline | None = None
        self.mirror_arms = False  # the engine's arms include a mirror strategy (set by prepare)
        self._next_executor: list[DraftExecutor | None] | None = None  # [executor or None] from its next step
        self._lock = threading.Lock()
        self._drafted_for: set[int] = set()  # sequences its executor's drafter may hold state of

    @property
    def exit_layer(self) -> int:
        return self.config.exit_layer or len(decoder_layers(self.target)) // 2

    # -- its life --------------------------------------------------------------------------
    def prepare(self, arms: Seq[Strategy]) -> None:
        """Refuse mirror arms it cannot run, and start its executor now, not inside a measured step."""
        self.mirror_arms = any(a.mirror for a in arms)
        if self.mirror_arms:
            if not isinstance(self.inner, DraftsBranches):
                raise ValueError(
                    f"mirror strategies need a drafter that drafts branches (DraftsBranches); "
                    f"the {self.inner.name} drafter does not"
                )
            check_exit_layer(self.target, self.exit_layer)
            self._ensure()

    def _ensure(self) -> MirrorPipeline:
        if self.pipeline is None:
            portable = isinstance(self.inner, Portable)
            executor = make_executor(
                self.config.executor,
                self.inner,
                self.inner.rebuild if portable else None,
                model_device_dtype(self.target)[0],
                next(self.inner.shipped_weights().parameters()).device if portable else None,
                self.config.draft_threads,
                self.kernels,
            )
            self.pipeline = MirrorPipeline(self.target, executor, self.exit_layer, self.inner)
        return self.pipeline

    def takes(self, strategy: Strategy) -> bool:
        """Whether it drafts steps of ``strategy``: mirror steps, and chains and trees while its
        pipeline runs (one drafter state for both)."""
        return strategy.mirror or (self.pipeline is not None and strategy.kind in ("chain", "tree"))

    @property
    def hostable(self) -> bool:
        """Its mirror steps can draft on a peer's draft host: the engine runs mirror arms, with a
        drafter rebuilt elsewhere that catches up from tokens alone (not the EAGLE-3 head: a host
        that starts late has none of the target's features for what was decoded before)."""
        return self.mirror_arms and isinstance(self.inner, Portable) and not self.inner.feature_layers

    def use_executor(self, executor: DraftExecutor | None) -> None:
        """Draft on ``executor`` (a peer's draft host) from its next step on; None: on its own
        executor again. Safe from any thread; an executor it cannot use is closed at once."""
        if executor is not None and not self.hostable:
            executor.close()
            return
        with self._lock:
            self._next_executor = [executor]

    def _switch(self) -> None:
        """Take the executor :meth:`use_executor` asked for: between steps, nothing of its in flight."""
        with self._lock:
            pending, self._next_executor = self._next_executor, None
        if pending is not None:
            self._ensure().use_executor(pending[0], sorted(self._drafted_for))

    def close(self) -> None:
        """Stop its executor's thread or process, and any executor still waiting to be taken."""
        with self._lock:
            pending, self._next_executor = self._next_executor, None
        if pending is not None and pending[0] is not None:
            pending[0].close()
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    # -- a step ------------------------------------------------------------------------------
    def draft(self, step: DraftStep) -> list[DraftTree]:
        """From the host's text (a ready draft is a branch its tokens must match exactly): a mirror
        step's ready drafts, the rest drafted now, or a chain or tree on its executor's drafter; a
        mirror step of a failed pipeline runs as its serial strategy (and says so on ``step``)."""
        self._switch()
        requests, strategy = step.on_host(), step.strategy
        pipeline = self._ensure()
        if strategy.mirror and pipeline.failed:
            strategy = step.strategy = Strategy("chain" if strategy.shape.is_chain else "tree", strategy.shape)
        self._drafted_for.update(r.seq.seq_id for r in requests)
        if strategy.mirror:
            return pipeline.drafts(step.seqs, requests, strategy)
        return pipeline.serial_step(requests, strategy.shape) if requests else []

    @contextmanager
    def beside_verify(self, seqs: Seq[Sequence], trees: Seq[DraftTree], strategy: Strategy) -> Iterator[None]:
        """The verification forward of ``trees``, with the next round drafting beside it (mirror steps)."""
        if not strategy.mirror:
            yield
            return
        with self.pipeline.overlap(seqs, trees, strategy):
            yield

    def settle(self, seqs: Seq[Sequence], trees: Seq[DraftTree], verdicts: Seq, strategy: Strategy, bases) -> None:
        """What the verification kept of each draft (``bases``: each sequence's tokens before the step)."""
        if strategy.mirror:
            self.pipeline.settle(seqs, trees, verdicts, strategy, bases)
            return
        for seq, verdict in zip(seqs, verdicts):
            self.pipeline.drafter.settled(seq, Settled(len(verdict.path)))

    # -- the rest of the drafter contract ------------------------------------------------------
    def observe_batch(self, observed, features: torch.Tensor, logits: torch.Tensor) -> None:
        """A copy of the drafter in a draft process reads the tapped features too (the engine hands
        its own drafter them itself)."""
        pipeline = self.pipeline
        if pipeline is not None and pipeline.drafter is not self.inner:
            try:
                pipeline.drafter.observe_batch(observed, features, logits)
            except ExecutorError as e:
                pipeline.fail(e)

    def release(self, seq_id: int) -> None:
        self._drafted_for.discard(seq_id)
        pipeline = self.pipeline
        if pipeline is not None:
            pipeline.release(seq_id)
            if pipeline.drafter is not self.inner and not pipeline.failed:
                pipeline.drafter.release(seq_id)


def make_executor(
    kind: str,
    drafter: Drafter,
    rebuild: Callable[[], Callable[[], Drafter]] | None,
    target_device: torch.device,
    draft_device: torch.device | None,
    threads: int,
    kernels: str = "auto",
) -> DraftExecutor:
    """The executor ``kind`` names (``auto``: ``stream`` or ``device`` on CUDA, ``process`` on CPU
    where the drafter can be rebuilt in a child, else ``thread``); a process or an actor drafts
    under the ``kernels`` backend (a thread inherits the caller's)."""
    if kind not in EXECUTORS:
        raise ValueError(f"mirror executor must be one of {EXECUTORS}, got {kind!r}")
    elsewhere = draft_device is not None and draft_device != target_device
    if kind == "auto":
        if target_device.type == "cuda":
            kind = "device" if elsewhere else "stream"
        else:
            kind = "process" if rebuild is not None else "thread"
    if kind == "inline":
        return InlineExecutor(drafter)
    if kind == "thread":
        return ThreadExecutor(drafter)
    if kind == "stream":
        if target_device.type != "cuda":
            raise ValueError("mirror executor 'stream' needs the target on a CUDA device")
        return ThreadExecutor(drafter, target_device, name="stream")
    if kind == "device":
        if not elsewhere:
            raise ValueError(
                f"mirror executor 'device' needs the drafter on another device than the target's {target_device}"
            )
        return ThreadExecutor(drafter, draft_device, name="device")
    if rebuild is None:
        raise ValueError(
            f"mirror executor {kind!r} cannot run the {drafter.name} drafter in another process "
            "(it has no rebuild(): it drafts with this process's target); use 'thread' or 'inline'"
        )
    if kind == "ray":
        return RayExecutor(rebuild(), threads, source=drafter, kernels=kernels)
    return ProcessExecutor(rebuild(), threads, source=drafter, kernels=kernels)


def mirror_pipeline(drafters: DrafterSet) -> MirrorPipeline | None:
    """The mirror pipeline of an engine's drafters, once a mirror step (or a strategy with mirror
    arms) started it: its executor and stats."""
    return drafters.mirror.pipeline if isinstance(drafters.mirror, MirrorDrafter) else None
