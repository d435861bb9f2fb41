"""The drafter contract, as drafters import it: everything is defined in
:mod:`tailspec.draft_contract` (the bottom of the package, which the engine depends on)."""

from ..draft_contract import EMPTY_DRAFT, Drafter, DrafterSet, DraftRequest, DraftShape, DraftTree, SequenceView

__all__ = ["EMPTY_DRAFT", "DraftRequest", "DraftShape", "DraftTree", "Drafter", "DrafterSet", "SequenceView"]
