"""A captured forward's static inputs, filled from the host with one copy per dtype.

Before every replay the host hands a captured graph its padded inputs: token ids, positions,
slot mapping, the split-KV kernel's block tables and lengths, a dozen small tensors. Built on
the device one by one and then copied into the graph's static buffers, they cost two CUDA calls
each, and a GPU machine's host pays about 15-20 µs for each. Here the static inputs are views of one device buffer
per dtype; the host tensors are packed into one pinned host buffer per dtype and copied over in
one asynchronous copy each. Packing and unpacking are the same code on CPU, where the buffers
are plain memory and the copy a memcpy.
"""

from __future__ import annotations

import torch

Inputs = dict[str, torch.Tensor]


class StagedInputs:
    """Static input buffers on ``device`` shaped as ``example`` (its dtypes, shapes, names):
    ``views`` are what a captured forward reads; :meth:`load` fills them from new inputs."""

    def __init__(self, example: Inputs, device: torch.device) -> None:
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        self._layout: dict[torch.dtype, list[tuple[str, int, int]]] = {}  # dtype -> (name, offset, numel)
        sizes: dict[torch.dtype, int] = {}
        for name, tensor in example.items():
            offset = sizes.get(tensor.dtype, 0)
            self._layout.setdefault(tensor.dtype, []).append((name, offset, tensor.numel()))
            sizes[tensor.dtype] = offset + tensor.numel()
        self._device_buffers = {dt: torch.empty(n, dtype=dt, device=self.device) for dt, n in sizes.items()}
        # an empty group (the gathering path's mask when the split-KV kernel runs) needs no copy
        self._host_buffers = {dt: torch.empty(n, dtype=dt, pin_memory=pinned) for dt, n in sizes.items() if n}
        self.views: Inputs = {}
        for dtype, entries in self._layout.items():
            for name, offset, numel in entries:
                self.views[name] = self._device_buffers[dtype][offset : offset + numel].view(example[name].shape)
        # recorded after each load's copies (this one's first): the pinned buffers are rewritten
        # only once they are done
        self._copied = torch.cuda.Event() if pinned else None
        self.load(example)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._device_buffers.values())

    def load(self, inputs: Inputs) -> None:
        """Copy ``inputs`` (the example's names and shapes; on the host, or already on the device)
        into the static buffers."""
        if inputs.keys() != self.views.keys():
            raise ValueError(f"inputs {sorted(inputs)} are not the captured forward's {sorted(self.views)}")
        for name, tensor in inputs.items():
            if tensor.shape != self.views[name].shape or tensor.dtype != self.views[name].dtype:
                raise ValueError(
                    f"input {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the captured forward's "
                    f"{tuple(self.views[name].shape)} {self.views[name].dtype}"
                )
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are free again once the last copy is done
        for dtype, entries in self._layout.items():
            if dtype not in self._host_buffers:
                continue
            on_host = [(name, offset, numel) for name, offset, numel in entries if inputs[name].device.type == "cpu"]
            host = self._host_buffers[dtype]
            if len(on_host) == len(entries):
                torch.cat([inputs[name].reshape(-1) for name, _, _ in entries], out=host)
            else:
                for name, offset, numel in on_host:
                    host[offset : offset + numel].copy_(inputs[name].reshape(-1))
            if on_host:
                self._device_buffers[dtype].copy_(host, non_blocking=True)
            # a caller's own device tensors (a greedy draft's tokens): copied on the device, after
            # the host copy, over its stale rows
            for name, _, _ in entries:
                if inputs[name].device.type != "cpu":
                    self.views[name].copy_(inputs[name], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
