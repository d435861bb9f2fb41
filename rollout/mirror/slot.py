"""The engine's mirror speculation: the :class:`MirrorPipeline` (started at the first mirror step or
when a strategy that may run one is set), the draft executor it drafts on (swapped between steps
for a peer's draft host), and what the engine's other steps owe it.

Once a mirror executor runs, chain and tree steps draft on its drafter too (``hybrid`` keeps the
in-process one its fusion wraps): serial and mirror steps then share one drafter state, so an
adaptive engine switching between ``chain:4`` and ``mirror:chain:4`` does not catch a second copy of
the drafter up on every token the other one drafted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...draft_contract import Drafter, DraftTree, Portable
from ..model.early_exit import check_exit_layer
from ..model.kv_cache import BlockAllocator
from ..model.layer_taps import decoder_layers
from ..model.runner import model_device_dtype
from ..params import EXECUTORS, MirrorConfig
from ..request import Sequence
from ..strategy import Strategy
from .executors import DraftExecutor, ExecutorError, InlineExecutor, ThreadExecutor
from .hosted import RayExecutor
from .pipeline import MirrorPipeline
from .process_executor import ProcessExecutor


class MirrorSlot:
    def __init__(
        self, model: torch.nn.Module, drafter: Drafter | None, config: MirrorConfig | None, kernels: str = "auto"
    ) -> None:
        self.model, self.drafter = model, drafter
        self.config = config or MirrorConfig()
        self.kernels = kernels  # RolloutConfig.kernels, for a draft process or actor
        self.pipeline: MirrorPipeline | None = None
        self._next_executor: list[DraftExecutor | None] | None = None  # [executor or None] from the next step

    @property
    def exit_layer(self) -> int:
        return self.config.exit_layer or len(decoder_layers(self.model)) // 2

    def prepare(self, arms: list[Strategy]) -> None:
        """Refuse mirror arms this engine cannot run, and start the executor now, not inside a
        measured step."""
        if any(a.mirror for a in arms):
            check_exit_layer(self.model, self.exit_layer)
            self.ensure()

    def ensure(self) -> MirrorPipeline:
        if self.pipeline is None:
            portable = isinstance(self.drafter, Portable)
            draft_device = next(self.drafter.shipped_weights().parameters()).device if portable else None
            executor = make_executor(
                self.config.executor,
                self.drafter,
                self.drafter.rebuild if portable else None,
                model_device_dtype(self.model)[0],
                draft_device,
                self.config.draft_threads,
                self.kernels,
            )
            self.pipeline = MirrorPipeline(self.model, executor, self.exit_layer, self.drafter)
        return self.pipeline

    def hostable(self, arms: list[Strategy], reads_features: bool) -> bool:
        """Mirror steps among ``arms``, with a drafter that a peer's draft host can take over
        mid-rollout: one rebuilt elsewhere that catches up from tokens alone (not the EAGLE-3 head:
        a host that starts late has none of the target's features for what was decoded before)."""
        return any(a.mirror for a in arms) and isinstance(self.drafter, Portable) and not reads_features

    def use_executor(self, executor: DraftExecutor | None) -> None:
        """From the next step, draft on ``executor`` (None: the slot's own again); thread-safe."""
        self._next_executor = [executor]

    @property
    def switch_pending(self) -> bool:
        return self._next_executor is not None

    def switch_between_steps(self, alive: list[int], hostable: bool) -> None:
        """Take the executor :meth:`use_executor` asked for (closed unhandled when no mirror step can
        use it); ``alive``: the sequences a new executor must catch up on."""
        pending, self._next_executor = self._next_executor, None
        if pending is None:
            return
        if not hostable:
            if pending[0] is not None:
                pending[0].close()
            return
        self.ensure().use_executor(pending[0], alive)

    def split_threads(self, strategy: Strategy) -> None:
        """With ``threads`` set, a mirror step gives the target ``threads - draft_threads`` of them."""
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads - (self.config.draft_threads if strategy.mirror else 0))

    def for_step(self, strategy: Strategy) -> tuple[Strategy, MirrorPipeline | None]:
        """The pipeline a mirror step drafts on; a failed one falls back to the serial strategy."""
        if not strategy.mirror:
            return strategy, None
        pipeline = self.ensure()
        if pipeline.failed:
            return Strategy("chain" if strategy.shape.is_chain else "tree", strategy.shape), None
        return strategy, pipeline

    def serial_drafts(
        self, strategy: Strategy, seqs: list[Sequence], allocator: BlockAllocator, block_size: int, drafting: list[bool]
    ) -> tuple[list[DraftTree], Drafter] | None:
        """A chain or tree step's drafts on the running pipeline's drafter (None: no pipeline runs)."""
        if self.pipeline is None or strategy.kind not in ("chain", "tree"):
            return None
        return self.pipeline.serial_step(seqs, strategy.shape, allocator, block_size, drafting)

    def observe(self, observed, features: torch.Tensor, logits: torch.Tensor) -> None:
        """A copy of the drafter in a draft process reads the tapped features too."""
        if self.pipeline is not None and self.pipeline.drafter is not self.drafter:
            try:
                self.pipeline.drafter.observe_batch(observed, features, logits)
            except ExecutorError as e:
                self.pipeline.fail(e)

    def release(self, seq_id: int) -> None:
        if self.pipeline is not None:
            self.pipeline.release(seq_id)
            if self.pipeline.drafter is not self.drafter and not self.pipeline.failed:
                self.pipeline.drafter.release(seq_id)

    def close(self) -> None:
        """Stop the draft executor's thread or process, if one was started."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None


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
