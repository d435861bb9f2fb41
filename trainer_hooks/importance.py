"""The importance-sampling correction of TRL's GRPO loss, computed from the loss forward itself.

TRL corrects the loss by ``exp(trainer logprob - rollout logprob)`` (per token, or summed per
sequence), truncated or masked outside ``[clip_min, clip_max]``. It gets the trainer's logprobs
from an extra no-grad forward right after generation. When training is on-policy (TRL's own test:
``gradient_accumulation_steps`` is a multiple of ``steps_per_generation * num_iterations``), no
optimizer step separates that forward from the loss forward, so both see the same weights and the
loss forward's detached logprobs are the same numbers: :func:`importance_sampling_ratio` computes the
ratio from them and the extra forward is skipped (``tailspec.GRPOTrainer`` does this by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """The correction factor TRL multiplies the per-token loss by: ``(B, T)`` for ``token_*`` modes,
    ``(B, 1)`` for ``sequence_*``. Tokens the rollout could not score (NaN) get no correction."""
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {MODES}, got {mode!r}")
    log_ratio = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@dataclass
class ImportanceStats:
    """What TRL logs about the correction (``sampling/...`` keys), for one batch."""

    logp_difference_mean: float
    logp_difference_max: float
    ratio_min: float
    ratio_mean: float
    ratio_max: float

    @classmethod
    def of(
        cls,
        trainer_logps: torch.Tensor,
        sampling_logps: torch.Tensor,
        mask: torch.Tensor,
        ratio: torch.Tensor,
        sequence_level: bool,
    ) -> ImportanceStats:
        delta = (trainer_logps - sampling_logps).abs()
        valid = mask.bool() & ~torch.isnan(delta)
        delta = delta[valid]
        flat = ratio.flatten() if sequence_level else ratio[mask.bool()]

        def stat(t: torch.Tensor, fn) -> float:
            return float(fn(t)) if t.numel() else 0.0

        return cls(
            stat(delta, torch.mean),
            stat(delta, torch.max),
            stat(flat, torch.min),
            stat(flat, torch.mean),
            stat(flat, torch.max),
        )

    def as_metrics(self) -> dict[str, float]:
        return {
            "sampling/sampling_logp_difference/mean": self.logp_difference_mean,
            "sampling/sampling_logp_difference/max": self.logp_difference_max,
            "sampling/importance_sampling_ratio/min": self.ratio_min,
            "sampling/importance_sampling_ratio/mean": self.ratio_mean,
            "sampling/importance_sampling_ratio/max": self.ratio_max,
        }
