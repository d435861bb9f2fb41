"""EAGLE-3 drafting: the head (``model``), its engine drafter (``drafter``), training data captured
from rollouts (``data``), online training (``train``), checkpoints and SGLang/vLLM export
(``checkpoint``)."""

from .data import Eagle3Sample, FeatureBuffer, SequenceRecorder
from .drafter import Eagle3Drafter
from .model import Eagle3Config, Eagle3Head

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Head", "Eagle3Sample", "FeatureBuffer", "SequenceRecorder"]
