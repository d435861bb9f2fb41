"""verl's per-request sampling fields as tailspec's :class:`SamplingParams`, refusing what would
change the sampled distribution without verl knowing."""

from __future__ import annotations

from typing import Any

from ...rollout.params import SamplingParams

# what verl's agent loop sends (and the SGLang-style names it accepts); anything else is refused
KNOWN = {
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_new_tokens", "logprobs", "seed",
    "ignore_eos", "repetition_penalty", "stop_token_ids",
}  # fmt: skip


def sampling_from_verl(fields: dict[str, Any], default_max_tokens: int, room: int) -> SamplingParams:
    """``fields`` (one request's ``sampling_params``) as :class:`SamplingParams`: ``top_k`` -1 (verl's
    "off") or 0 is off; ``max_tokens`` defaults to ``default_max_tokens`` (the rollout's response
    length) and is capped by ``room`` (what the context leaves after the prompt). ``logprobs`` are
    always returned, so its value is accepted and not needed."""
    unknown = sorted(set(fields) - KNOWN)
    if unknown:
        raise ValueError(f"sampling_params {unknown} are not supported by tailspec; supported: {sorted(KNOWN)}")
    if room < 1:
        raise ValueError(f"the prompt leaves no room to generate within the model's context ({room} tokens left)")
    penalty = fields.get("repetition_penalty", 1.0)
    if penalty not in (None, 1.0):
        raise ValueError(f"sampling_params repetition_penalty = {penalty} is not supported by tailspec (only 1.0)")
    max_tokens = fields.get("max_tokens", fields.get("max_new_tokens"))
    max_tokens = default_max_tokens if max_tokens is None else int(max_tokens)
    top_k = int(fields.get("top_k", 0) or 0)
    return SamplingParams(
        temperature=float(fields.get("temperature", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        top_p=float(fields.get("top_p", 1.0)),
        min_p=float(fields.get("min_p", 0.0) or 0.0),
        max_new_tokens=max(1, min(max_tokens, room)),
        seed=fields.get("seed"),
        ignore_eos=bool(fields.get("ignore_eos", False)),
        stop_token_ids=tuple(fields.get("stop_token_ids", ()) or ()),
    )
