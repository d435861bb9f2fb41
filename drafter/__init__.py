"""Drafters: what proposes draft tokens for speculative decoding.

``Drafter`` is the contract (``draft_contract.py``: ``draft`` from a ``DraftStep``, the one way to
draft, and ``settled`` once the step is read); ``SmallLMDrafter`` drives a smaller Hugging Face LM
with its own paged KV cache; ``SuffixDrafter`` drafts from n-gram statistics of the prompt group
and earlier completions.
"""

from ..draft_contract import (
    DeviceDrafts,
    Drafter,
    DraftRequest,
    DraftShape,
    DraftStep,
    DraftTree,
    Settled,
    draft_from_text,
)
from .small_lm import SmallLMDrafter
from .suffix import SuffixDrafter

__all__ = [
    "DeviceDrafts",
    "DraftRequest",
    "DraftShape",
    "DraftStep",
    "DraftTree",
    "Drafter",
    "Settled",
    "SmallLMDrafter",
    "SuffixDrafter",
    "draft_from_text",
]
