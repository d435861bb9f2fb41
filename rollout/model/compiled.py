"""The decoder layers' own ops compiled by ``torch.compile`` (Inductor) for the engine's forwards
(``RolloutConfig.compile``, issue 48).

A decoder layer of a Hugging Face model runs some 40 small kernels at decode time: RMSNorms,
RoPE, casts, the activation and its product, residual adds, each a launch of a few microseconds
around the GEMMs. Inductor fuses them into a few Triton kernels per layer. The engine's paged
attention is left out of the compiled regions (``torch.compiler.disable``): each layer compiles
as the region before attention (norm, QKV projections, RoPE) and the region after it
(output projection, residual, norm, MLP). Shapes are dynamic, so one compile serves every batch
size and layer; the graph pool's warm-up runs trigger it before a CUDA graph captures the
compiled kernels.

The new tokens' K/V write is traced too: while the compiled layers run, each layer's attention
module carries its own cache tensors (``attention.BOUND_KV``), so the write needs no layer index
(an int dynamo would specialise on, one compile per layer) and Inductor fuses it with RoPE, the
cast and the layout change into the region before attention. The binding names its cache: a
forward of the same modules over another cache (a model drafting for itself) writes where its
own metadata says. A layer without a ``self_attn`` module (not the Hugging Face convention)
writes its K/V outside the compiled region, as eager layers do.

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

from .attention import BOUND_KV
from .kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

BACKEND = "inductor"  # torch.compile's backend (the tests swap in "eager": dynamo's tracing alone, no code generation)


class CompiledLayers:
    """Compiled ``forward``s of a model's decoder layers, made on first use."""

    def __init__(self, layers: torch.nn.ModuleList, cache: PagedKVCache) -> None:
        self.layers = list(layers)
        self.cache = cache
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
        attentions = [attn for attn in map(_attention_of, self.layers) if attn is not None]
        for layer, compiled in zip(self.layers, self._compiled):
            layer.forward = compiled
        for attn in attentions:
            setattr(attn, BOUND_KV, (self.cache, self.cache.k[attn.layer_idx], self.cache.v[attn.layer_idx]))
        try:
            yield
        finally:
            for layer in self.layers:
                vars(layer).pop("forward", None)
            for attn in attentions:
                vars(attn).pop(BOUND_KV, None)

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


def _attention_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's attention module by the Hugging Face convention (``self_attn``, holding ``layer_idx``)."""
    attn = layer._modules.get("self_attn")
    return attn if attn is not None and isinstance(getattr(attn, "layer_idx", None), int) else None
