"""Buckets a draft executor's thread ran without a graph, captured later on the pool's owner thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

import torch

from ...kernels.dispatch import kernel_backend
from .attention import AttentionMetadata, SequenceSlice
from .graph_pool import GraphKey, GraphPool, input_signature
from .kv_cache import PagedKVCache

# (slices, tokens, positions, key) -> a bucket's padded inputs, metadata and rows (ModelRunner.padded_inputs)
PaddedInputs = Callable[..., tuple[dict[str, torch.Tensor], AttentionMetadata, object]]
# (metadata, key) -> what the pool captures for the bucket (ModelRunner._padded_forward_fn)
CapturedFn = Callable[[AttentionMetadata, GraphKey], Callable]

logger = logging.getLogger(__name__)


def capture_missed(
    pool: GraphPool | None, cache: PagedKVCache, scratch_slot: int, padded_inputs: PaddedInputs, forward_fn: CapturedFn
) -> int:
    """Capture, on this thread (the pool's owner), the buckets a draft executor's thread ran
    without a graph since the last call: each from padding alone, one row that writes the
    scratch slot, so no sequence's cache is touched. Call it while no other thread uses the
    pool (a mirror pipeline does, once its branches are collected). A bucket is captured for
    the attention path the other thread ran (its inputs' names and shapes); one whose capture
    fails is logged and left to run uncaptured. Returns how many were captured.

    Mirror-SD's draft thread meets shapes of its own (continuations one token deeper than the
    serial chains), which the owner never ran: without this call they would run eagerly for
    the whole rollout."""
    if pool is None:
        return 0
    captured = 0
    device = cache.layout.device  # a drafter on another GPU captures on its own
    for key, signature in pool.take_missed().items():
        built = _padding_like(cache, scratch_slot, padded_inputs, key, signature)
        if built is None:
            logger.debug("no padding inputs match %s's; it runs uncaptured", key)
            continue
        kernels, inputs, meta = built
        on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
        try:
            with on_device, kernel_backend(kernels, ("attention",)):
                pool.run(key, forward_fn(meta, key), inputs)
            captured += 1
        except Exception:  # the bucket keeps running uncaptured, as before
            logger.warning("could not capture %s for a draft thread", key, exc_info=True)
    return captured


def _padding_like(
    cache: PagedKVCache, scratch_slot: int, padded_inputs: PaddedInputs, key: GraphKey, signature
) -> tuple[str, dict[str, torch.Tensor], AttentionMetadata] | None:
    """Inputs of bucket ``key`` holding padding alone (one row, written to the scratch slot),
    built for the attention path (``torch``: gathered slots; ``triton``: block tables) whose
    inputs have ``signature``; None when neither has."""
    padding = SequenceSlice([scratch_slot // cache.block_size], 0, 1)
    for kernels in ("torch", "triton"):
        try:
            with kernel_backend(kernels, ("attention",)):
                inputs, meta, _ = padded_inputs([padding], [0], [0], key)
        except Exception:  # a path this machine cannot run (no Triton)
            continue
        if input_signature(inputs) == signature:
            return kernels, inputs, meta
    return None
