"""Small host <-> device transfers that do not stall the host.

A decode step moves a few small arrays each way: indices and flags to the device, sampled tokens,
verdicts and logprobs back. Done plainly, each one waits for the device:

* ``tensor.to("cuda")`` from ordinary (pageable) host memory synchronizes the stream first, so
  the host idles until every kernel it queued (a whole graph replay) has run, and only then
  prepares the next forward. :func:`to_device` copies from page-locked memory (torch's caching
  host allocator keeps the block until the copy is done) and returns at once.
* every ``tolist()`` of a device tensor waits for the device. :func:`read_back` reads several
  tensors in one transfer, so a step waits once where it needs its results.

Each wait leaves the device idle while the host catches up, and a speculative step that waits
a few dozen times keeps the device busy a third of its wall time. On CPU both functions are
plain conversions.
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
    return _split(_flat(tensors).tolist(), _layout(tensors))


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every value of ``tensors`` in one float64 tensor on their device (one transfer's worth)."""
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


def _layout(tensors: Sequence[torch.Tensor]) -> list[tuple[int, bool]]:
    return [(t.numel(), t.is_floating_point()) for t in tensors]


def _split(flat: list[float], layout: list[tuple[int, bool]]) -> list[list]:
    """``flat`` cut back into each tensor's values (ints for an integer tensor's)."""
    out, start = [], 0
    for numel, floating in layout:
        part = flat[start : start + numel]
        start += numel
        out.append(part if floating else [int(v) for v in part])
    return out


class QueuedCopy:
    """Tensors copied to the host behind the work that computes them: made, it queues each copy
    (on CUDA into page-locked memory, with an event after them) and returns at once; :meth:`result`
    waits for those copies alone, not for work queued after them, and :meth:`ready` asks without
    waiting. On CPU the host tensors are ``tensors`` themselves: the caller hands over tensors it
    does not change afterwards (on CUDA the copies hold the values of the moment they run)."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"a queued copy's tensors must share one device, got {sorted(map(str, devices))}")
        self._done: torch.cuda.Event | None = None
        if devices and next(iter(devices)).type == "cuda":
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
            for host, tensor in zip(self._host, tensors):
                host.copy_(tensor.detach(), non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(tensors[0].device))
        else:
            self._host = tuple(t.detach().cpu() for t in tensors)

    def ready(self) -> bool:
        """Whether the copies have landed (never waits)."""
        return self._done is None or self._done.query()

    def result(self) -> tuple[torch.Tensor, ...]:
        """The host tensors, in the order given (waits for the copies on CUDA)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host


class QueuedRead:
    """:func:`read_back` in two halves: made, it queues the transfer behind the work that computes
    ``tensors`` (a :class:`QueuedCopy` of their values) and returns at once; :meth:`result` waits
    for that transfer alone. An engine that launches its next forward between the two (the
    engine's loop, ``rollout/launched.py``) keeps the device busy while the host reads. (The wait is an
    event's, which torch's sync debug mode does not flag.)"""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._layout = _layout(tensors)
        self._copy = QueuedCopy(_flat(tensors) if tensors else torch.zeros(0, dtype=torch.float64))

    def result(self) -> list[list]:
        """Each tensor's values, as :func:`read_back` gives them (waits for the transfer on CUDA)."""
        (flat,) = self._copy.result()
        return _split(flat.tolist(), self._layout)
