"""Inputs of a forward whose sequence lengths live on the device.

A speculative step launched before the step in flight is committed (``rollout/spec/device_step.py``)
does not know on the host how many tokens each sequence accepted: its lengths are a device tensor
``cached`` (the tokens each sequence has in the cache before the forward). What the host knows are
upper bounds: it reserved every sequence's blocks for a fully accepted draft, so its block tables
are final, and every sequence contributes the same number of new tokens, ``new``, at positions
``cached + 0 .. cached + new - 1``. Everything that depends on the lengths (positions, the slots the
new K/V go to, the attention mask or the kernel's cached lengths) is computed here from ``cached``
on the device, without a read.

The shapes are those of :func:`~.padded_metadata.build_padded_metadata` (``[batch, tokens,
context]``, padding rows writing the scratch slot), so a captured graph replays these inputs as it
replays the host's, and the eager path runs the same tensors unpadded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np
import torch

from ...kernels.paged_attention import PagedAttentionPlan, _causal
from ...kernels.transfers import to_device
from .attention import AttentionMetadata
from .kv_cache import PagedKVCache


@dataclass(frozen=True)
class TreeRows:
    """How a forward's ``new`` rows of each sequence relate, where not as a chain: row ``r`` is at
    position ``cached + offsets[r]`` and sees new row ``j`` where ``visible[r, j]`` (itself and its
    ancestors); row ``r`` still writes cache index ``cached + r``. A leading dimension of 1 is the
    same layout for every sequence (a drafter's static paths), else one per sequence (a draft tree)."""

    offsets: torch.Tensor  # [1 or B, new] int64
    visible: torch.Tensor  # [1 or B, new, new] bool


@lru_cache(maxsize=64)
def static_paths(paths: int, length: int, device: torch.device) -> TreeRows:
    """``paths`` independent chains of ``length`` rows each, path-major: row ``i * length + j`` is
    path ``i``'s ``j``-th token, at offset ``j``, seeing its own path's rows up to itself (made once
    a shape: never written to)."""
    new = paths * length
    path_of, step = np.divmod(np.arange(new), length)
    visible = (path_of[:, None] == path_of[None, :]) & (step[None, :] <= step[:, None])
    return TreeRows(to_device(step[None].astype(np.int64), device), to_device(visible[None], device))


class BlockTables:
    """One step's block tables (the host's lists, final for the step), padded to a shape on the
    device once per shape: a drafter's forwards in a step share theirs."""

    def __init__(self, tables: Sequence[list[int]]) -> None:
        self.tables = tables
        self._padded: dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.tables)

    def longest(self) -> int:
        return max(len(t) for t in self.tables)

    def padded(self, batch: int, width: int, fill: int, device: torch.device) -> torch.Tensor:
        """``[batch, width]`` int64 on ``device``: each table's first ``width`` blocks, then ``fill``."""
        key = (batch, width, fill, device)
        if key not in self._padded:
            lengths = np.fromiter((len(t) for t in self.tables), np.int64, len(self.tables))
            table = np.full((batch, width), fill, dtype=np.int64)
            if (lengths <= width).all():
                flat = np.fromiter(chain.from_iterable(self.tables), np.int64, int(lengths.sum()))
                table[: len(self.tables)][np.arange(width) < lengths[:, None]] = flat
            else:
                for i, t in enumerate(self.tables):
                    table[i, : min(len(t), width)] = t[:width]
            self._padded[key] = to_device(table, device)
        return self._padded[key]


def completion_offsets(seqs: Sequence) -> np.ndarray:
    """``[len(seqs)]`` int64: what turns a sequence's cached length on the device (its pending
    token's position) into the completion index of the token that follows it (``1 - prompt length``)."""
    return 1 - np.fromiter((len(seq.prompt_ids) for seq in seqs), np.int64, len(seqs))


def device_inputs(
    cache: PagedKVCache,
    tables: BlockTables,
    cached: torch.Tensor,
    ids: torch.Tensor,
    new: int,
    shape: tuple[int, int, int],
    scratch_block: int,
    use_plan: bool,
    tree: TreeRows | None = None,
) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
    """The inputs (the names and layout :meth:`ModelRunner.padded_inputs` gives a captured forward)
    and metadata of a forward of ``len(tables)`` sequences with ``new`` tokens each (``ids``:
    ``[len(tables) * new]`` on the device, sequence-major), padded to ``shape`` = ``(batch, tokens,
    context)``. ``cached``: ``[len(tables)]`` int64 on the device. Rows past a sequence's ``new``
    tokens and padding sequences write block ``scratch_block``; every sequence's block table must
    hold its context (``cached + new`` tokens), which the caller reserved from upper bounds.
    ``tree``: the rows' positions and visibility where they are not a chain."""
    batch, tokens, context = shape
    n, bs, device = len(tables), cache.block_size, cached.device
    width = -(-context // bs)
    table_t = tables.padded(batch, width, scratch_block, device)
    valid, valid_t, columns = _row_layout(batch, tokens, n, new, device)
    lengths = torch.cat([cached, cached.new_zeros(batch - n)]) if batch > n else cached
    index = lengths.unsqueeze(1) + columns  # [batch, tokens]: each row's cache index
    visible = None if tree is None else _padded_visible(tree, n, batch, tokens)  # [batch, tokens, tokens]
    at = index if tree is None else lengths.unsqueeze(1) + _padded(tree.offsets, (batch, tokens))
    positions = torch.where(valid_t, at, torch.zeros_like(index))
    block = table_t.gather(1, (index // bs).clamp(max=width - 1))
    slot_mapping = torch.where(valid_t, block * bs + index % bs, torch.full_like(index, scratch_block * bs))
    padded_ids = ids if ids.numel() == batch * tokens else _scattered(ids, valid)
    plan = None
    if use_plan:  # the kernel reads block tables and lengths, not gathered slots and masks
        gather = torch.zeros(batch, 0, dtype=torch.int64, device=device)
        mask = torch.zeros(batch, 1, tokens, 0, dtype=torch.bool, device=device)
        plan = _kernel_plan(table_t, lengths, positions, visible, n, new, bs)
    else:
        gather, mask = _gathered(table_t, lengths, index, valid_t, visible, context, bs)
    meta = AttentionMetadata(
        cache=cache,
        slot_mapping=slot_mapping.reshape(-1),
        gather_slots=gather,
        mask=mask,
        query_positions=positions,
        num_seqs=batch,
        max_new=tokens,
        query_index=None,
        valid_queries=None,
        plan=plan,
    )
    return _captured_inputs(padded_ids, meta), meta


def _captured_inputs(ids: torch.Tensor, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    """A captured forward's inputs by name (``ModelRunner.padded_inputs``'s layout)."""
    positions = meta.query_positions
    inputs = {"ids": ids.view(1, -1), "pos": positions.view(1, -1), "slot_mapping": meta.slot_mapping}
    inputs.update(gather_slots=meta.gather_slots, mask=meta.mask, query_positions=positions)
    if meta.plan is not None:
        inputs.update({f"plan.{k}": v for k, v in meta.plan.tensors().items()})
    return inputs


@lru_cache(maxsize=256)
def _row_layout(batch: int, tokens: int, n: int, new: int, device: torch.device) -> tuple:
    """Which of a padded forward's ``[batch, tokens]`` rows are real (on the host and the device) and
    the column indices ``0 .. tokens - 1``: the same for every forward of a shape, made once (never
    written to)."""
    valid = np.zeros((batch, tokens), dtype=bool)
    valid[:n, :new] = True
    return valid, to_device(valid, device), torch.arange(tokens, device=device)


@lru_cache(maxsize=64)
def _key_layout(context: int, block_size: int, device: torch.device) -> tuple:
    """The key indices ``0 .. context - 1`` of a padded forward, their blocks and their offsets in
    them: made once a shape (never written to)."""
    keys = torch.arange(context, device=device)
    return keys, keys // block_size, keys % block_size


def _scattered(ids: torch.Tensor, valid: np.ndarray) -> torch.Tensor:
    """``ids`` (the valid rows', in order) at their rows of a zero-padded ``valid.size`` vector."""
    rows = to_device(np.flatnonzero(valid), ids.device)
    return ids.new_zeros(valid.size).index_copy_(0, rows, ids)


def _kernel_plan(
    table: torch.Tensor,
    lengths: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor | None,
    n: int,
    new: int,
    block_size: int,
) -> PagedAttentionPlan:
    """What the Triton kernels read of a padded forward: block tables, lengths, each row's position
    and the rows' visibility among themselves (a chain's causal mask where ``visible`` is None)."""
    batch, tokens = positions.shape
    device = positions.device
    query_lens = np.where(np.arange(batch) < n, new, 0)
    return PagedAttentionPlan(
        block_tables=table.to(torch.int32),
        cached_lens=lengths.to(torch.int32),
        query_lens=to_device(query_lens.astype(np.int32), device),
        query_start=to_device((np.arange(batch) * tokens).astype(np.int32), device),
        query_positions=positions.reshape(-1).to(torch.int32),
        tree_mask=(
            to_device(np.broadcast_to(_causal(tokens), (batch, tokens, tokens)).copy(), device)
            if visible is None
            else visible.to(torch.uint8)
        ),
        block_size=block_size,
        max_query_len=tokens,
    )


def _gathered(
    table: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor,
    visible: torch.Tensor | None,
    context: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the gathering path reads of a padded forward: every row's context slots ``[batch,
    context]`` and its mask ``[batch, 1, tokens, context]`` (the cached prefix and the new rows it
    sees: those up to itself in a chain, ``visible``'s in a tree)."""
    batch, tokens = index.shape
    keys, key_blocks, key_offsets = _key_layout(context, block_size, index.device)
    gather = table.gather(1, key_blocks.expand(batch, -1)) * block_size + key_offsets
    if visible is None:  # the cached prefix and the rows up to itself
        mask = valid.unsqueeze(-1) & (keys <= index.unsqueeze(-1))
    else:  # the cached prefix and the new rows it sees
        new_row = keys - lengths.unsqueeze(1)  # [batch, context]: the new row a key holds, if any
        among = (new_row >= 0) & (new_row < tokens)
        sees = visible.gather(2, new_row.clamp(0, tokens - 1).unsqueeze(1).expand(-1, tokens, -1))
        mask = valid.unsqueeze(-1) & ((new_row < 0).unsqueeze(1) | (among.unsqueeze(1) & sees))
    mask[:, :, 0] = True  # padding rows see one key (for real rows key 0 is visible anyway)
    return gather, mask.unsqueeze(1)


def _padded(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``values`` (a leading dimension of 1 broadcast) in the top-left corner of zeros of ``shape``."""
    if values.shape[0] == 1:
        values = values.expand(shape[0], *values.shape[1:])
    if tuple(values.shape) == shape:
        return values
    out = values.new_zeros(shape)
    out[tuple(slice(0, n) for n in values.shape)] = values
    return out


def _padded_visible(tree: TreeRows, n: int, batch: int, tokens: int) -> torch.Tensor:
    """``tree.visible`` for the ``n`` sequences in a causal ``[batch, tokens, tokens]`` (what the
    host's padded plans hold past the real rows)."""
    visible = tree.visible.expand(n, -1, -1)
    out = torch.ones(tokens, tokens, dtype=torch.bool, device=visible.device).tril().repeat(batch, 1, 1)
    out[:n, : visible.shape[1], : visible.shape[2]] = visible
    return out
