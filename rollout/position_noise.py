"""Position-keyed sampling: a completion that is a function of the model, the prompt and the seed alone.

A request with ``SamplingParams(noise="position", seed=s)`` draws the token at completion index
``i`` as ``argmax(logprobs + g)``, where ``g`` is Gumbel noise computed from ``(s, i, token id)``
by a counter-based hash (Gumbel-max: the argmax is an exact sample of ``softmax(logprobs)``).
The noise does not come from a stream that drafts, rejections or batch neighbours consume, so

- plain decoding, every speculative strategy and every drafter emit the same tokens: a
  verification step is greedy verification on the perturbed scores (the target's token at each
  row is fixed before any draft is looked at), and a model drafter that perturbs its own
  logprobs with the same noise proposes the target's token whenever the two agree closely;
- a request continued on another worker, or recomputed after preemption, draws what it would
  have drawn.

The cost is acceptance: the chance that a drafter's perturbed argmax equals the target's is at
most the ``a = sum(min(p, q))`` that rejection sampling reaches, and at least ``a / (2 - a)``
(the Gumbel-max coupling bound), more than half of it.
RL runs use it where the trajectory itself must not depend on the drafter (comparing drafters on
one shared policy trajectory, reproducing a run with speculation switched off).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels.transfers import to_device

if TYPE_CHECKING:
    from .params import SamplingParams

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31: every product below fits in int64, so the hash is exact on any device


def _mix32(x):
    """A 32-bit integer finalizer on int64 values in [0, 2**32): torch tensors or numpy arrays."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def _key_words(seed: int) -> tuple[int, int]:
    s = seed % 2**64  # a negative seed and its two's complement are the same key
    return s & _MASK32, s >> 32


def _seed_keys(seeds: Sequence[int]) -> np.ndarray:
    """Each row's seed hashed to 32 bits (the part of its key that no index changes)."""
    words = np.asarray([_key_words(s) for s in seeds], dtype=np.int64).reshape(-1, 2)
    return _mix32(_mix32(words[:, 0] ^ 0x68E31DA4) ^ words[:, 1])


def _row_keys(seeds: Sequence[int], indices: Sequence[int]) -> np.ndarray:
    """Each row's 32-bit key from ``(seed, index)``, hashed on the host: a few operations on ``R``
    numbers, which on a GPU would be as many kernel launches."""
    return _mix32(_seed_keys(seeds) ^ (np.asarray(indices, dtype=np.int64) & _MASK32))


@functools.lru_cache(maxsize=16)
def _token_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """Each token id's 32-bit key ``[vocab]``, made once per vocabulary and device."""
    return _mix32(torch.arange(vocab, dtype=torch.int64, device=device) ^ 0x1B56C4E9)


def _uniforms_of(rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, vocab]`` float64 uniforms in (0, 1) from the rows' keys (on the device). Two 32-bit
    hashes give 53 random bits per entry."""
    h1 = _mix32(rows.unsqueeze(-1) ^ _token_keys(vocab, rows.device))  # [R, V]
    h2 = _mix32(h1 ^ 0x5BD1E995)
    bits = (h1 << 21) | (h2 >> 11)  # 53 bits
    return (bits.double() + 0.5) / float(2**53)


def _gumbel_of(rows: torch.Tensor, vocab: int) -> torch.Tensor:
    return (-torch.log(-torch.log(_uniforms_of(rows, vocab)))).float()


def position_uniforms(seeds: Sequence[int], indices: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, vocab]`` float64 uniforms in (0, 1): row ``r`` keyed on ``(seeds[r], indices[r])``,
    column ``j`` on the token id."""
    return _uniforms_of(to_device(_row_keys(seeds, indices), device), vocab)


def position_gumbel(seeds: Sequence[int], indices: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))``, ``[R, vocab]`` float32, keyed as :func:`position_uniforms`."""
    return _gumbel_of(to_device(_row_keys(seeds, indices), device), vocab)


def keyed_scores(
    logprobs: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For rows of ``logprobs`` with their request's ``params`` and completion ``indices``: None when
    no row is position-keyed, else the perturbed scores (keyed rows plus their noise, other rows
    unchanged) and a ``[R]`` bool mask of the keyed rows (whose token is the argmax of their
    scores). The rows' keys and the mask reach the device in one queued copy (no wait: a draft
    chain runs its forwards without one)."""
    keyed = [p.position_keyed for p in params]
    if not any(keyed):
        return None
    seeds = [p.seed if k else 0 for p, k in zip(params, keyed)]
    packed = to_device(np.stack([_row_keys(seeds, indices), np.asarray(keyed, dtype=np.int64)]), logprobs.device)
    mask = packed[1].bool()
    scores = torch.where(mask.unsqueeze(-1), logprobs + _gumbel_of(packed[0], logprobs.shape[-1]), logprobs)
    return scores, mask


def keyed_scores_at(
    logprobs: torch.Tensor, params: Sequence[SamplingParams], indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`keyed_scores` with the rows' completion ``indices`` a tensor on the device (a step
    launched before the host knows its sequences' lengths): the seeds' part of each key is hashed
    on the host, the index's on the device, the same hash."""
    keyed = [p.position_keyed for p in params]
    if not any(keyed):
        return None
    seeds = [p.seed if k else 0 for p, k in zip(params, keyed)]
    packed = to_device(np.stack([_seed_keys(seeds), np.asarray(keyed, dtype=np.int64)]), logprobs.device)
    mask = packed[1].bool()
    rows = _mix32(packed[0] ^ (indices.to(torch.int64) & _MASK32))
    scores = torch.where(mask.unsqueeze(-1), logprobs + _gumbel_of(rows, logprobs.shape[-1]), logprobs)
    return scores, mask


def derived_seed(*parts: int) -> int:
    """A seed in ``[0, 2**63)`` that is a stable function of ``parts`` (a run's seed, an RL step, a
    request's index): the same on every machine and Python process."""
    digest = hashlib.blake2b(b",".join(str(int(p)).encode() for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
