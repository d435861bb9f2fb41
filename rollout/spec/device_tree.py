"""Draft trees verified on the device: the pieces a tree step launched before the step in flight
is read needs beyond a chain's (``device_step.py``).

A tree of ``n`` nodes per sequence lives in two ``[B, n]`` tensors, its tokens and its parents
(node indices, ``-1`` for a child of the root), in topological order with siblings in the order
they are tried. The target runs the pending token (row 0) and the nodes (row ``i + 1``, at
position ``cached + depth``, seeing its ancestors: :func:`tree_rows`);
``verdicts.tree_verdicts`` walks every tree at once, level by level, exactly as ``verify.py``
walks one; :func:`keep_path_kv` moves the accepted nodes' K/V to the positions that follow the
sequence, on the device.
"""

from __future__ import annotations

import torch

from ..model.device_inputs import TreeRows
from ..model.kv_cache import PagedKVCache


def tree_rows(parents: torch.Tensor, depth: int) -> TreeRows:
    """The verification forward's rows for trees with ``parents`` ``[B, n]`` (at most ``depth``
    deep): row 0 the pending token, row ``i + 1`` node ``i`` at offset ``depth(i)``, each row
    seeing the root, its ancestors and itself."""
    batch, n = parents.shape
    up = torch.cat([parents.new_zeros(batch, 1), parents + 1], dim=1)  # [B, n + 1]: each row's parent row
    visible = torch.eye(n + 1, dtype=torch.bool, device=parents.device).expand(batch, -1, -1).clone()
    visible[:, :, 0] = True
    depths = (torch.arange(n + 1, device=parents.device) > 0).long().expand(batch, -1).clone()
    above = up
    for _ in range(depth):  # after step t each row sees its ancestors up to t levels up
        visible.scatter_(2, above.unsqueeze(2), True)
        depths += above > 0  # a node above it: one level deeper
        above = up.gather(1, above)
    return TreeRows(depths, visible)


def keep_path_kv(
    cache: PagedKVCache, tables: torch.Tensor, cached: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor
) -> None:
    """Node ``i`` was written at cache index ``cached + 1 + i``; the ``j``-th accepted node belongs
    at ``cached + 1 + j``. Every move at once on the device (``tables``: the padded block tables
    ``[B, W]``, covering ``cached + 1 + n``); a row past the accept length copies a slot onto itself."""
    bs = cache.block_size
    j = torch.arange(path.shape[1], device=path.device)
    dst = cached.unsqueeze(1) + 1 + j
    src = torch.where(j < accepted.unsqueeze(1), cached.unsqueeze(1) + 1 + path, dst)

    def slots(index: torch.Tensor) -> torch.Tensor:
        return (tables.gather(1, index // bs) * bs + index % bs).reshape(-1)

    cache.move_slots(slots(src), slots(dst))
