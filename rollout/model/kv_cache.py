"""Paged KV cache: a pool of fixed-size blocks with reference counts, and per-layer K/V storage.

A sequence owns a *block table* (a list of block ids); the token at cache index ``c`` of that
sequence lives in slot ``table[c // block_size] * block_size + c % block_size`` of every layer's
flat ``[num_slots, kv_heads, head_dim]`` tensor. Prompt groups share their full prefix blocks
(reference counted) and each member owns a copy of the last, partially filled block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class OutOfBlocks(RuntimeError):
    """Raised by :class:`BlockAllocator` when the pool cannot satisfy a request."""


class BlockAllocator:
    """Free list and reference counts over ``num_blocks`` block ids.

    With ``cache_prefixes`` a full block can be registered under the hash of the tokens it holds
    and every token before it (:func:`prefix_hashes`). When its last reference goes, such a block
    is kept, evictable, instead of freed: a later request whose tokens start the same way
    takes it back (:meth:`reuse`) rather than recomputing it. Evictable blocks count as free and
    are handed out, least recently released first, only when the free list is empty.
    """

    def __init__(self, num_blocks: int, cache_prefixes: bool = False) -> None:
        self.num_blocks = num_blocks
        self.cache_prefixes = cache_prefixes
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_of: dict[int, int] = {}  # prefix hash -> block
        self._hash_of: dict[int, int] = {}  # block -> prefix hash
        self.epoch = 0  # bumped by clear_prefixes: K/V computed before it must not be registered

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently released cached block
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
            self._refs[b] = 1
            blocks.append(b)
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
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # -- prefix caching ---------------------------------------------------------------------------
    def register(self, block: int, prefix_hash: int) -> None:
        """Record that ``block`` (in use, full) holds the K/V of the tokens ``prefix_hash`` names."""
        if not self.cache_prefixes or prefix_hash in self._block_of or block in self._hash_of:
            return
        if self._refs[block] <= 0:
            raise RuntimeError(f"registering free block {block}")
        self._block_of[prefix_hash] = block
        self._hash_of[block] = prefix_hash

    def lookup(self, prefix_hash: int) -> int | None:
        return self._block_of.get(prefix_hash)

    def reuse(self, block: int) -> None:
        """Take a reference to a cached block (reviving it if it was evictable)."""
        if block not in self._hash_of:
            raise RuntimeError(f"block {block} holds no cached prefix")
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def clear_prefixes(self) -> None:
        """Forget every cached prefix (e.g. the weights changed); evictable blocks become free."""
        self.epoch += 1
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()


def prefix_hashes(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """One hash per full block: of the block's tokens and, through the previous hash, all before."""
    hashes, previous = [], 0
    for i in range(num_blocks):
        previous = hash((previous, tuple(tokens[i * block_size : (i + 1) * block_size])))
        hashes.append(previous)
    return hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVLayout:
    """What each layer's cache holds per token: ``num_kv_heads`` heads of ``head_dim`` keys and
    values, unless ``layer_shapes`` says otherwise for some layer: ``(kv_heads, key size, value
    size)`` per layer (Gemma 4's per-layer head sizes; MLA's values smaller than its keys)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_shapes: tuple[tuple[int, int, int], ...] | None = None

    @classmethod
    def from_hf_config(cls, config, dtype: torch.dtype, device: torch.device) -> KVLayout:
        config = config.get_text_config(decoder=True)
        fields = config.to_dict()  # not getattr: a per-layer field (Gemma 4's head_dim) raises there
        heads = config.num_attention_heads
        head_dim = fields.get("head_dim") or config.hidden_size // heads
        kv_heads = fields.get("num_key_value_heads") or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype, device)

    def shape_of(self, layer: int) -> tuple[int, int, int]:
        """``(kv_heads, key size, value size)`` of ``layer``'s cache."""
        if self.layer_shapes is not None:
            return self.layer_shapes[layer]
        return self.num_kv_heads, self.head_dim, self.head_dim

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(heads * (k + v) * elem for heads, k, v in map(self.shape_of, range(self.num_layers)))


class PagedKVCache:
    """K and V storage of every layer plus the block allocator that hands out its slots."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, cache_prefixes: bool = False) -> None:
        self.layout = layout
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, cache_prefixes)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.restore()

    @property
    def released(self) -> bool:
        return not self.k

    def release(self) -> None:
        """Free the K/V memory (the blocks' bookkeeping stays; nothing may be running): a rollout
        server asleep while the trainer uses the device. :meth:`restore` brings it back, empty."""
        self.allocator.clear_prefixes()
        self.k, self.v = [], []

    def restore(self) -> None:
        """Allocate every layer's K/V (zeros), if it is not allocated."""
        if self.k:
            return
        layout, slots = self.layout, self.allocator.num_blocks * self.block_size
        shapes = [layout.shape_of(i) for i in range(layout.num_layers)]
        self.k = [torch.zeros(slots, h, k, dtype=layout.dtype, device=layout.device) for h, k, _ in shapes]
        self.v = [torch.zeros(slots, h, v, dtype=layout.dtype, device=layout.device) for h, _, v in shapes]

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
