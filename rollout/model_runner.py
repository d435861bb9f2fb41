"""Drives a Hugging Face causal LM over the paged KV cache.

This is the only module that calls the model, so a native forward (or a captured CUDA graph)
can replace it later without touching the scheduler or the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import METADATA_KWARG, SequenceSlice, build_metadata
from .kv_cache import KVLayout, PagedKVCache


def model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


def model_vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.device, self.dtype = model_device_dtype(model)
        self.vocab_size = model_vocab_size(model)
        self.layout = KVLayout.from_hf_config(model.config, self.dtype, self.device)
        self.cache = PagedKVCache(self.layout, num_blocks, block_size)

    def forward(
        self,
        seqs: Sequence[SequenceSlice],
        tokens: list[int],
        positions: list[int],
        logits_index: list[int],
    ) -> torch.Tensor:
        """Run one packed forward and return the logits of the packed positions ``logits_index``."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        keep = torch.tensor(logits_index, dtype=torch.long, device=self.device)
        meta = build_metadata(self.cache, seqs, pos)
        out = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=pos.unsqueeze(0),
            use_cache=False,
            logits_to_keep=keep,
            **{METADATA_KWARG: meta},
        )
        return out.logits[0]
