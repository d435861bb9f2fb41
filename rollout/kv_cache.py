"""Paged KV cache: a pool of fixed-size blocks with reference counts, and per-layer K/V storage.

A sequence owns a *block table* (a list of block ids); the token at cache index ``c`` of that
sequence lives in slot ``table[c // block_size] * block_size + c % block_size`` of every layer's
flat ``[num_slots, kv_heads, head_dim]`` tensor. Prompt groups share their full prefix blocks
(reference counted) and each member owns a copy of the last, partially filled block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


class OutOfBlocks(RuntimeError):
    """Raised by :class:`BlockAllocator` when the pool cannot satisfy a request."""


class BlockAllocator:
    """Free list and reference counts over ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """Add a reference to each block (a forked sequence reusing a prefix)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"sharing free block {b}")
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_hf_config(cls, config, dtype: torch.dtype, device: torch.device) -> KVLayout:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype, device)

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class PagedKVCache:
    """K and V storage of every layer plus the block allocator that hands out its slots."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int) -> None:
        self.layout = layout
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        slots = num_blocks * block_size
        shape = (slots, layout.num_kv_heads, layout.head_dim)
        self.k = [torch.zeros(shape, dtype=layout.dtype, device=layout.device) for _ in range(layout.num_layers)]
        self.v = [torch.zeros(shape, dtype=layout.dtype, device=layout.device) for _ in range(layout.num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def copy_block(self, src: int, dst: int, num_tokens: int | None = None) -> None:
        """Copy the first ``num_tokens`` slots of block ``src`` into ``dst`` in every layer."""
        n = self.block_size if num_tokens is None else num_tokens
        s, d = src * self.block_size, dst * self.block_size
        for k, v in zip(self.k, self.v):
            k[d : d + n] = k[s : s + n]
            v[d : d + n] = v[s : s + n]

    def slots(self, block_table: torch.Tensor, cache_index: torch.Tensor) -> torch.Tensor:
        """Flat slot ids of cache indices, given a (padded) block table of matching leading dims."""
        block = block_table.gather(-1, cache_index // self.block_size)
        return block * self.block_size + cache_index % self.block_size

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V at slots ``src`` to slots ``dst`` in every layer (all reads happen first)."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]


def slot_of(block_table: list[int], cache_index: int, block_size: int) -> int:
    """The flat slot of a sequence's token at ``cache_index``."""
    return block_table[cache_index // block_size] * block_size + cache_index % block_size
