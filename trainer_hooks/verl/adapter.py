"""The trainer side of the tailspec backend: verl's worker calls ``resume(["weights"])``,
``update_weights(<(name, tensor) generator>)``, ``resume(["kv_cache"])`` after every optimizer step,
and ``release()`` before training; this adapter forwards them to its replica's server actor.

Weights travel in buckets of ``checkpoint_engine.update_weights_bucket_megabytes`` (CPU copies,
one bucket at a time), so the push never holds a second full copy of the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

from ...extras import need
from .replica import server_name

ray = need("ray", "verl", "the verl rollout backend")
BaseRollout = need("verl.workers.rollout.base", "verl", "the verl rollout backend").BaseRollout

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_MB = 512


class TailspecServerAdapter(BaseRollout):
    """Registered for ``(rollout.name, mode) = ("tailspec", "async")``."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank if replica_rank == -1 else replica_rank  # one device a replica
        self._server: Any = None

    @property
    def server(self) -> Any:
        if self._server is None:  # the server is launched after the trainer's worker
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if "kv_cache" in tags and getattr(self.config, "free_cache_engine", True):
            await self.server.wake_up.remote(tags)

    async def release(self) -> None:
        if getattr(self.config, "free_cache_engine", True):
            await self.server.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self, weights: Any, wire_format: str = "named_tensors", global_steps: int | None = None, **kwargs: Any
    ) -> None:
        """Push ``weights`` (a sync or async generator of Hugging Face names and tensors) in buckets."""
        if wire_format != "named_tensors":
            raise ValueError(f"tailspec takes wire_format='named_tensors', got {wire_format!r}")
        bucket_mb = getattr(getattr(self.config, "checkpoint_engine", None), "update_weights_bucket_megabytes", None)
        limit = int(bucket_mb or DEFAULT_BUCKET_MB) << 20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = pushed = 0
        async for name, tensor in _each(weights):
            bucket.append((name, tensor.detach().to("cpu", copy=True).contiguous()))
            size += tensor.numel() * tensor.element_size()
            if size >= limit:
                pushed += await self.server.update_weights.remote(bucket, False)
                bucket, size = [], 0
        pushed += await self.server.update_weights.remote(bucket, True)
        if global_steps is not None:
            await self.server.set_global_steps.remote(global_steps)
        logger.info("tailspec replica %d: %d tensors pushed", self.replica_rank, pushed)


async def _each(weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator) -> AsyncIterator:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
