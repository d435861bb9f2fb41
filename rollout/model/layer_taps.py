"""The decoder of a Hugging Face causal LM, and hooks that capture what enters its layers: the
features an EAGLE-3 head drafts from, an early exit's hidden state, the LM head's input."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch


def decoder_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder (embeddings, layers, final norm) of a Hugging Face causal LM."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer stack of a Hugging Face causal LM."""
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to tap hidden states from")
    return layers


LM_HEAD_INPUT = -1  # a tap id: the final norm's output, which the LM head reads (streaming heads read it)


@contextmanager
def capture_layer_inputs(
    model: torch.nn.Module, layer_ids: Sequence[int], *, keep_all: bool = False
) -> Iterator[dict[int, Any]]:
    """Within the block, each forward stores the hidden states entering layer ``i`` at
    ``captured[i]`` (with ``keep_all``, appends them to the list ``captured[i]``, one per forward);
    for ``LM_HEAD_INPUT``, the final norm's output: every token's, whatever logits are kept."""
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not (0 <= i < len(layers) or i == LM_HEAD_INPUT)]
    if bad:
        raise ValueError(f"layer ids {bad} are outside the model's {len(layers)} decoder layers")
    captured: dict[int, Any] = {i: [] for i in layer_ids} if keep_all else {}

    def store(i: int, hidden: torch.Tensor) -> None:
        if keep_all:
            captured[i].append(hidden)
        else:
            captured[i] = hidden

    handles = []
    for i in sorted(set(layer_ids)):
        if i == LM_HEAD_INPUT:
            norm = getattr(decoder_of(model), "norm", None)
            if not isinstance(norm, torch.nn.Module):
                raise ValueError(f"cannot find the final norm of {type(model).__name__} to tap the LM head's input")
            handles.append(norm.register_forward_hook(lambda module, args, output: store(LM_HEAD_INPUT, output)))
            continue

        def hook(module, args, kwargs, i=i):
            store(i, args[0] if args else kwargs["hidden_states"])

        handles.append(layers[i].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def tapped(model: torch.nn.Module, layer_ids: Sequence[int]) -> AbstractContextManager[dict[int, Any]]:
    """:func:`capture_layer_inputs` where ``layer_ids`` are given, else nothing hooked."""
    return capture_layer_inputs(model, layer_ids) if layer_ids else nullcontext({})


def features_of(captured: dict[int, Any], layer_ids: Sequence[int]) -> torch.Tensor | None:
    """The tapped hidden states of one packed forward, ``[T, len(layer_ids) * hidden]`` (None: no taps)."""
    return torch.cat([captured[i][0] for i in layer_ids], dim=-1) if layer_ids else None
