"""The target's early-exit signal: its top-k next tokens read after layer ``L`` of a forward.

In the same forward that is running (no second pass over the early layers), a pre-hook on layer
``L`` takes the hidden states of the rows asked for, applies the model's own final norm and LM
head (Kangaroo / LayerSkip style, with no adapter), and hands the ``k`` best tokens per row to a
callback before layers ``L .. N-1`` run. Mirror speculative decoding (``rollout/mirror/pipeline.py``)
starts drafting from this signal while the rest of the forward runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .eval_mode import eval_mode
from .layer_taps import decoder_layers, decoder_of

# what the families name the norm after their last decoder layer: most ``norm``, Nemotron-H ``norm_f``,
# Falcon-H1 ``final_layernorm``
FINAL_NORM_NAMES = ("norm", "norm_f", "final_layernorm")


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm a Hugging Face causal LM applies after its last decoder layer."""
    decoder = decoder_of(model)
    for name in FINAL_NORM_NAMES:
        norm = decoder._modules.get(name)
        if isinstance(norm, torch.nn.Module):
            return norm
    raise ValueError(f"cannot find the final norm of {type(model).__name__} for an early exit")


def check_exit_layer(model: torch.nn.Module, layer: int, name: str = "mirror exit_layer") -> int:
    """``layer`` (the number of decoder layers run before the exit) if it is in ``[1, N - 1]``."""
    n = len(decoder_layers(model))
    if not (isinstance(layer, int) and not isinstance(layer, bool) and 1 <= layer <= n - 1):
        raise ValueError(f"{name} must be an int in [1, {n - 1}] for this {n}-layer model, got {layer!r}")
    return layer


def exit_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of hidden states taken after an intermediate layer: final norm, then the LM head."""
    return model.get_output_embeddings()(final_norm(model)(hidden)).float()


class EarlyExit:
    """Reads ``k`` candidate tokens per row after ``layer`` decoder layers of ``model``'s forward."""

    def __init__(self, model: torch.nn.Module, layer: int, k: int) -> None:
        self.model = model
        self.layer = check_exit_layer(model, layer)
        if not (isinstance(k, int) and 1 <= k <= 16):
            raise ValueError(f"early-exit k must be an int in [1, 16], got {k!r}")
        self.k = k

    @contextmanager
    def tap(self, rows: Sequence[int], on_signal: Callable[[list[list[int]]], None]) -> Iterator[None]:
        """Within the block, the next forward calls ``on_signal(topk)`` once, after ``layer``
        layers, with the ``k`` best tokens (best first) at each packed row in ``rows``."""
        fired = False

        def hook(module, args, kwargs):
            nonlocal fired
            if fired:
                return
            fired = True
            hidden = args[0] if args else kwargs["hidden_states"]
            index = torch.tensor(list(rows), dtype=torch.long, device=hidden.device)
            logits = exit_logits(self.model, hidden[0].index_select(0, index))
            on_signal(logits.topk(min(self.k, logits.shape[-1]), dim=-1).indices.tolist())

        handle = decoder_layers(self.model)[self.layer].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def exit_agreement(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], ks: Sequence[int]
) -> dict[int, dict[int, float]]:
    """How often the target's own next token (its argmax over each completion position) is among
    the early exit's top ``k``: ``{layer: {k: rate}}`` for every layer in ``[1, N - 1]``, over the
    completion positions of ``sequences`` (full token lists, teacher-forced in one forward each)."""
    n = len(decoder_layers(model))
    hits = {layer: dict.fromkeys(ks, 0) for layer in range(1, n)}
    total = 0
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for layer in range(1, n):

        def hook(module, args, kwargs, layer=layer):
            captured[layer] = args[0] if args else kwargs["hidden_states"]

        hooks.append(decoder_layers(model)[layer].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with eval_mode(model), torch.no_grad():
            for tokens, p in zip(sequences, prompt_lengths):
                ids = torch.tensor([list(tokens)], dtype=torch.long, device=next(model.parameters()).device)
                final = model(input_ids=ids).logits[0, p - 1 : -1].argmax(-1)
                total += final.numel()
                for layer in range(1, n):
                    top = exit_logits(model, captured[layer][0, p - 1 : -1]).topk(max(ks), dim=-1).indices
                    for k in ks:
                        hits[layer][k] += int((top[:, :k] == final.unsqueeze(-1)).any(-1).sum())
    finally:
        for h in hooks:
            h.remove()
    return {layer: {k: hits[layer][k] / max(total, 1) for k in ks} for layer in hits}
