"""The engine's copy of a model in another dtype (``RolloutConfig.dtype``).

A trainer with mixed precision keeps fp32 parameters and computes its forwards in bf16 (autocast).
Decoding on those fp32 weights reads twice the bytes of a bf16 model at every step, and a
verification forward of a few tokens per sequence runs fp32 matrix products (no tensor cores
without TF32), so speculation pays for more tokens than it saves (measured in docs/GPU.md: a
rollout from fp32 master weights gained little over plain decoding though 4 tokens a step were
accepted). The engine instead decodes on a copy of
the model whose floating-point parameters are in ``dtype``: what the trainer's autocast computes
its matrix products with (the same rounding of the same weights), as a rollout server (vLLM,
SGLang) holds for RL training.

The copy is a deep copy with each parameter replaced by its cast (tied parameters stay tied: one
copy per tensor); buffers are copied as they are, so RoPE's inverse frequencies keep their fp32.
What the trainer attached to its module is left out of the copy: instance-level ``forward``
wrappers (accelerate's) and hooks.
Before each rollout the engine calls :meth:`CastCopy.refresh`: when any source parameter changed
(an in-place change bumps its version counter; a ZeRO-3 gather or ``model.to`` moves it) or the
engine was told the weights changed (``RolloutEngine.weights_changed``: torch's fused AdamW,
transformers' default optimizer, bumps no version counter; ``SpecRollout`` says so before every
rollout), every parameter is cast again into the copy's own tensors, which never move, so graphs
captured on the copy stay valid. Memory: the model's parameters once more in ``dtype`` (2 bytes a
parameter for bf16, next to the 16 of fp32 weights with Adam's two moments).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)


class CastCopy:
    """``model``: a copy of ``source`` whose floating-point parameters are in ``dtype``."""

    def __init__(self, source: torch.nn.Module, dtype: torch.dtype) -> None:
        memo: dict[int, object] = {}
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for param in source.parameters():  # each tensor once: a tied weight is one pair
            cast = torch.empty_like(param, dtype=dtype if param.is_floating_point() else param.dtype)
            memo[id(param)] = copied = torch.nn.Parameter(cast, requires_grad=False)
            self._pairs.append((param, copied))
        try:
            self.model = copy.deepcopy(source, memo)
        except Exception as e:  # a wrapper holding what cannot be copied (locks, process groups)
            raise ValueError(
                f"RolloutConfig.dtype={str(dtype)[6:]!r}: cannot copy {type(source).__name__} to decode in that "
                f"dtype ({type(e).__name__}: {e}); pass the unwrapped Hugging Face model, or dtype='auto'"
            ) from e
        for module in self.model.modules():
            _detach_from_source(module)
        self._fingerprint: int | None = None
        self.refresh()
        logger.info(
            "rollout weights: a %s copy of the model's parameters (%.1f MB)", str(dtype)[6:], self.nbytes / 2**20
        )

    @property
    def nbytes(self) -> int:
        return sum(copied.numel() * copied.element_size() for _, copied in self._pairs)

    def forget(self) -> None:
        """The next :meth:`refresh` casts again, whatever version counters say (a fused optimizer
        step changes parameters without bumping them: ``ModelRunner.weights_changed``)."""
        self._fingerprint = None

    def refresh(self) -> bool:
        """Cast the source's parameters into the copy again if any of them changed since the last
        refresh (version counters and addresses) or :meth:`forget` was called; whether it did."""
        fingerprint = weights_fingerprint(p for p, _ in self._pairs)
        if fingerprint == self._fingerprint:
            return False
        with torch.no_grad():
            for param, copied in self._pairs:
                copied.copy_(param)
        self._fingerprint = fingerprint
        return True


def weights_fingerprint(params: Iterable[torch.Tensor]) -> int:
    """Where ``params`` live and how often each was changed in place: it moves when one moved or an
    in-place change bumped its version counter (a fused optimizer step bumps none)."""
    return hash(tuple((p.data_ptr(), p._version) for p in params))


def _detach_from_source(module: torch.nn.Module) -> None:
    """Drop what the copy took over from the trainer's module but must not run: an instance-level
    ``forward`` (accelerate's autocast and output-cast wrappers close over the source's own
    ``forward``, so the copy would run the source: the first GRPO run on a copy decoded garbage)
    and forward and backward hooks (a trainer's feature taps, ZeRO-3's gathers)."""
    module.__dict__.pop("forward", None)
    for hooks in (
        module._forward_hooks,
        module._forward_hooks_with_kwargs,
        module._forward_hooks_always_called,
        module._forward_pre_hooks,
        module._forward_pre_hooks_with_kwargs,
        module._backward_hooks,
        module._backward_pre_hooks,
    ):
        hooks.clear()


def rollout_model(model: torch.nn.Module, dtype: str) -> tuple[torch.nn.Module, CastCopy | None]:
    """The model the engine decodes on for ``RolloutConfig.dtype``: ``model`` itself when ``dtype``
    is ``auto`` or already its parameters' dtype, else a :class:`CastCopy`'s (returned with it)."""
    if dtype == "auto":
        return model, None
    wanted = getattr(torch, dtype)  # a name RolloutConfig checked: bfloat16, float16 or float32
    if next(model.parameters()).dtype == wanted:
        return model, None
    cast = CastCopy(model, wanted)
    return cast.model, cast
