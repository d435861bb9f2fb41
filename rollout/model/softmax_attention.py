"""Attention written out, for what SDPA cannot express: the logit soft cap (Gemma 2) and per-head
sink logits (gpt-oss) some families add to softmax attention. The paged attention's torch path
(``attention.py``) calls it for such layers; the Triton kernels compute the same (``capped``,
``with_sink``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionExtras:
    """What some families add to softmax attention: per-head sink logits, a logit soft cap."""

    sinks: torch.Tensor | None = None
    softcap: float | None = None

    def __bool__(self) -> bool:
        return self.sinks is not None or bool(self.softcap)


NO_EXTRAS = AttentionExtras()  # plain softmax attention: one instance, not one a layer call


def softmax_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    extras: AttentionExtras,
) -> torch.Tensor:
    """Attention written out, for what SDPA cannot express: logits ``scale * q k^T``, capped to
    ``softcap * tanh(s / softcap)`` before the mask (Gemma 2), and a per-head sink logit that takes
    a share of the softmax and gives no value (gpt-oss). ``[B, H, Q, D]`` queries over ``[B, kv_heads,
    L, D]`` keys and values (expanded for grouped queries) and a ``[B, 1, Q, L]`` mask."""
    heads, kv_heads = queries.shape[1], keys.shape[1]
    if heads != kv_heads:
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
    logits = (queries @ keys.transpose(-1, -2)).float() * scale
    if extras.softcap:
        logits = extras.softcap * torch.tanh(logits / extras.softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    if extras.sinks is not None:
        sink = extras.sinks.float().view(1, heads, 1, 1).expand(*logits.shape[:-1], 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = logits.softmax(dim=-1)
    return probs.to(values.dtype) @ values
