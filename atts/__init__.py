"""ATTS: asynchronous test-time scaling with a conformal takeover rule, on the tailspec engine.

A small draft model writes each chunk of a sample's reasoning; the target scores it with one
prefill; a conformal test against calibration scores decides whether the target takes over.
See :class:`ATTSRunner` (asynchronous), :func:`run_synchronous` (per-turn barrier baseline) and
``tailspec atts`` / ``examples/atts_tiny_task.py``.
"""

from .clients import EngineActor, EngineClient, LocalEngineClient, RayEngineClient
from .config import ATTSConfig
from .conformal import (
    ConformalCalibration,
    Decision,
    NeverTakeover,
    OnlineConformal,
    SplitConformal,
    binomial_interval,
    make_policy,
)
from .evaluate import Accuracy, majority_vote, pass_at_k, score_answers
from .runner import ATTSEvent, ATTSResult, ATTSRunner, SampleResult, check_tokenizers_match, sample_only
from .sample import Author, Turn
from .sync import run_synchronous, takeover_budget

__all__ = [
    "ATTSConfig",
    "ATTSEvent",
    "ATTSResult",
    "ATTSRunner",
    "Accuracy",
    "Author",
    "ConformalCalibration",
    "Decision",
    "EngineActor",
    "EngineClient",
    "LocalEngineClient",
    "NeverTakeover",
    "OnlineConformal",
    "RayEngineClient",
    "SampleResult",
    "SplitConformal",
    "Turn",
    "binomial_interval",
    "check_tokenizers_match",
    "majority_vote",
    "make_policy",
    "pass_at_k",
    "run_synchronous",
    "sample_only",
    "score_answers",
    "takeover_budget",
]
