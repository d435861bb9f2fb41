"""The rollout engine: paged KV cache, continuous batching, sampling."""

from .engine import EngineStats, RolloutEngine
from .params import RolloutConfig, SamplingParams
from .request import FinishReason, RequestOutput

__all__ = ["EngineStats", "FinishReason", "RequestOutput", "RolloutConfig", "RolloutEngine", "SamplingParams"]
