"""Drafters: what proposes draft tokens for speculative decoding.

``Drafter`` is the contract (``base.py``); ``SmallLMDrafter`` drives a smaller Hugging Face LM
with its own paged KV cache; ``SuffixDrafter`` drafts from n-gram statistics of the prompt group
and earlier completions.
"""

from ..draft_contract import Drafter, DraftRequest, DraftShape, DraftTree
from .small_lm import SmallLMDrafter
from .suffix import SuffixDrafter

__all__ = ["DraftRequest", "DraftShape", "DraftTree", "Drafter", "SmallLMDrafter", "SuffixDrafter"]
