"""Token ids as users hand them over (lists of Python or numpy integers, 1-D integer numpy arrays
or torch tensors), made into a plain ``list[int]``, or refused with a ``ValueError`` that names
the field and says what is wrong with its type. Ranges are checked where the vocabulary is known
(:class:`tailspec.rollout.engine.RequestLimits`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _is_integer_dtype(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return np.issubdtype(dtype, np.integer)


def token_id(value: Any, name: str) -> int:
    """One token id as an ``int``; bools, floats and anything else not integer are refused."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} = {value!r} is a bool; token ids must be integers")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0 and _is_integer_dtype(value.dtype):
        return int(value.item())
    kind = f"a {value.dtype} scalar" if isinstance(value, (torch.Tensor, np.ndarray)) else type(value).__name__
    raise ValueError(f"{name} = {value!r} has type {kind}; token ids must be integers")


def token_id_list(ids: Any, name: str = "prompt_ids") -> list[int]:
    """A sequence of token ids as ``list[int]``: a list or tuple of integers, or a 1-D integer
    array or tensor."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(ids, torch.Tensor) else "array"
        if ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got a {ids.ndim}-D {kind} of shape {tuple(ids.shape)}")
        if not _is_integer_dtype(ids.dtype):
            raise ValueError(f"{name} is a {kind} of dtype {ids.dtype}; token ids must be integers")
        return [int(t) for t in ids.tolist()]
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} is text ({type(ids).__name__}); tokenize it into token ids first")
    try:
        items = list(ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of token ids, got {type(ids).__name__}") from None
    return [token_id(tok, f"{name}[{i}]") for i, tok in enumerate(items)]
