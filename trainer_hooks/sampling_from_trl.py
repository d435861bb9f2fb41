"""Translate a TRL ``GRPOConfig`` into :class:`SamplingParams`, refusing what cannot be honoured."""

from __future__ import annotations

import json
from typing import Any

from ..rollout.params import SamplingParams

# generation_kwargs keys SpecRollout understands; anything else is refused, never ignored.
SUPPORTED_GENERATION_KWARGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_new_tokens",
    "max_tokens",
    "stop_token_ids",
    "seed",
    "do_sample",
    "repetition_penalty",
)


def _as_dict(value: dict | str | None, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object string, got {type(value).__name__}")
    return dict(value)


def sampling_params_from_trl(args: Any) -> SamplingParams:
    """Sampling parameters equivalent to what TRL's own generation would use for ``args``."""
    gen = _as_dict(getattr(args, "generation_kwargs", None), "generation_kwargs")
    unknown = sorted(set(gen) - set(SUPPORTED_GENERATION_KWARGS))
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown} are not supported by SpecRollout; supported: "
            f"{list(SUPPORTED_GENERATION_KWARGS)}"
        )
    repetition_penalty = gen.pop("repetition_penalty", getattr(args, "repetition_penalty", 1.0))
    if repetition_penalty not in (None, 1.0):
        raise ValueError(
            f"repetition_penalty = {repetition_penalty} is not supported by SpecRollout (only 1.0): "
            "it would change the sampled distribution without the trainer knowing"
        )
    max_new = gen.pop("max_new_tokens", gen.pop("max_tokens", getattr(args, "max_completion_length", None)))
    if max_new is None:
        raise ValueError("max_completion_length must be set (an int >= 1) to use SpecRollout")
    temperature = gen.pop("temperature", getattr(args, "temperature", 1.0))
    if gen.pop("do_sample", True) is False:
        temperature = 0.0
    top_k = gen.pop("top_k", getattr(args, "top_k", 0))
    min_p = gen.pop("min_p", getattr(args, "min_p", None))
    return SamplingParams(
        temperature=float(temperature),
        top_k=int(top_k or 0),
        top_p=float(gen.pop("top_p", getattr(args, "top_p", 1.0))),
        min_p=float(min_p or 0.0),
        max_new_tokens=max_new,
        stop_token_ids=tuple(gen.pop("stop_token_ids", ()) or ()),
        seed=gen.pop("seed", None),
    )
