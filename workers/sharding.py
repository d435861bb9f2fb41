"""How one rollout's requests are dealt to workers."""

from __future__ import annotations

from collections.abc import Sequence


def shard_requests(prompts: Sequence[Sequence[int]], num_shards: int) -> list[list[int]]:
    """Request indices per shard: identical prompts stay together (a GRPO group is prefilled once
    and its suffix drafter sees the siblings); groups go largest first to the least loaded shard
    (load = requests). No shard is empty."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(shards, key=len).extend(members)
    return [sorted(s) for s in shards if s]
