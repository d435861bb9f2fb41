"""Rows of a padded forward (a captured bucket's): the real ones taken out of its output, and values
put at them in a zero-padded input."""

from __future__ import annotations

import numpy as np
import torch

from ...kernels.transfers import select_rows, to_device


def take_rows(output: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """``output[rows]`` as a tensor of its own (a replay's output buffer is overwritten by the next
    replay): a copy of a slice where the rows run in order from 0, as a decode step's and a full
    verification's do, else a gather whose index is queued without waiting for the device."""
    if runs_from_zero(rows):
        return output[: rows.size].clone()
    return select_rows(output, rows)


def runs_from_zero(rows: np.ndarray) -> bool:
    """Whether ``rows`` are ``0, 1, ..., n - 1``: then a slice stands for them."""
    return np.array_equal(rows, np.arange(rows.size))


def put_rows(values: torch.Tensor, rows: np.ndarray, size: int) -> torch.Tensor:
    """A ``[size]`` tensor on ``values``' device: ``values`` at ``rows``, zeros elsewhere."""
    out = values.new_zeros(size)
    if runs_from_zero(rows):
        out[: rows.size] = values
    else:
        out.index_copy_(0, to_device(rows, values.device), values)
    return out
