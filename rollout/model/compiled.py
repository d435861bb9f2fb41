"""The decoder layers' own ops compiled by ``torch.compile`` (Inductor) for the engine's forwards
(``RolloutConfig.compile``).

A decoder layer of a Hugging Face model runs some 40 small kernels at decode time: RMSNorms,
RoPE, casts, the activation and its product, residual adds, each a launch of a few microseconds
around the GEMMs. Inductor fuses them into a few Triton kernels per layer. The engine's paged
attention is left out of the compiled regions (``torch.compiler.disable``): each layer compiles
as the region before attention (norm, QKV projections, RoPE) and the region after it
(output projection, residual, norm, MLP). Shapes are dynamic, so one compile serves every batch
size and layer; the graph pool's warm-up runs trigger it before a CUDA graph captures the
compiled kernels.

The new tokens' K/V rows (their layout change and cast) are traced and fuse with RoPE; their
scatter into the paged cache runs with the attention, outside the compiled region. Traced, the
scatter becomes an out-of-place copy of the layer's whole cache on CUDA (measured: most of a
batch-1 step; docs/GPU.md), though Inductor's C++ code on CPU writes in place.

The compiled forwards are swapped in only while the engine runs the model (``active()``), as an
instance attribute over each layer's ``forward``: the trainer's forwards, and forward hooks (the
drafters' feature taps), stay as they are. A model whose layers torch.compile cannot compile
runs them eagerly from then on, as before, and the log says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch._dynamo.exc import TorchDynamoException

logger = logging.getLogger(__name__)

BACKEND = "inductor"  # torch.compile's backend (the tests swap in "eager": dynamo's tracing alone, no code generation)


class CompiledLayers:
    """Compiled ``forward``s of a model's decoder layers, made on first use."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.layers = list(layers)
        self._compiled: list | None = None
        self.failed: str | None = None  # why compiling failed; the layers then run eagerly

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within the block each layer's ``forward`` is its compiled one."""
        if self._compiled is None:
            self._compiled = [self._fallible(self._compile(layer), layer) for layer in self.layers]
        own = [type(layer).__name__ for layer in self.layers if "forward" in vars(layer)]
        if own:  # checked before any is swapped: a refusal leaves every layer as it was
            raise ValueError(f"{own[0]} already has its own forward; cannot compile it")
        for layer, compiled in zip(self.layers, self._compiled):
            layer.forward = compiled
        try:
            yield
        finally:
            for layer in self.layers:
                vars(layer).pop("forward", None)

    @staticmethod
    def _compile(layer: torch.nn.Module) -> Callable:
        compiled = torch.compile(layer.forward, dynamic=True, backend=BACKEND)

        def forward(*args, **kwargs):
            # the attention's graph break (nested two calls deep) ends the graph there instead of
            # splitting the layer at each enclosing call: the input norm, QKV, RoPE and the K/V
            # write trace as one graph, o_proj to the MLP as the other
            with torch._dynamo.config.patch(nested_graph_breaks=True):
                return compiled(*args, **kwargs)

        return forward

    def _fallible(self, compiled: Callable, layer: torch.nn.Module) -> Callable:
        """``compiled``, or the layer's own forward once compiling has failed for any layer."""
        eager = type(layer).forward.__get__(layer)

        def forward(*args, **kwargs):
            if self.failed is None:
                try:
                    return compiled(*args, **kwargs)
                except TorchDynamoException as e:  # compiling failed; an eager rerun rewrites what ran
                    self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    logger.warning(
                        "RolloutConfig.compile: torch.compile cannot compile %s (%s); its layers run eagerly",
                        type(layer).__name__,
                        self.failed,
                    )
            return eager(*args, **kwargs)

        return forward
