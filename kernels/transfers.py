"""Small host <-> device transfers that do not stall the host.

A decode step moves a few small arrays each way: indices and flags to the device, sampled tokens,
verdicts and logprobs back. Done plainly, each one waits for the device:

* ``tensor.to("cuda")`` from ordinary (pageable) host memory synchronizes the stream first, so
  the host idles until every kernel it queued (a whole graph replay) has run, and only then
  prepares the next forward. :func:`to_device` copies from page-locked memory (torch's caching
  host allocator keeps the block until the copy is done) and returns at once.
* every ``tolist()`` of a device tensor waits for the device. :func:`read_back` reads several
  tensors in one transfer, so a step waits once where it needs its results.

GPU run 13 (docs/GPU.md) counted 24.5 stream synchronizations in a batch-1 ``chain:4`` step that
kept the device busy 5.1 ms of 15. On CPU both functions are plain conversions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: np.ndarray | torch.Tensor | Sequence, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``values`` (a host array, tensor or list) as a tensor on ``device``, without waiting for the
    device: on CUDA the copy is queued from page-locked memory."""
    tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(values))
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    device = torch.device(device)
    if device.type == "cpu" and tensor.device.type == "cpu":
        return tensor
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def select_rows(tensor: torch.Tensor, rows: np.ndarray | Sequence[int]) -> torch.Tensor:
    """``tensor[rows]`` (rows of its first dimension, given on the host), the index queued to the
    tensor's device without waiting: indexing with a host list would copy it with a sync."""
    return tensor.index_select(0, to_device(np.asarray(rows, dtype=np.int64), tensor.device))


def read_back(*tensors: torch.Tensor) -> list[list]:
    """Each tensor's values as a flat list (ints for integer tensors, floats otherwise), read in one
    device-to-host transfer. Exact for floats up to 64 bits and integers up to 2**53 (token ids,
    row indices)."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        part = flat[start : start + t.numel()]
        start += t.numel()
        out.append(part if t.is_floating_point() else [int(v) for v in part])
    return out
