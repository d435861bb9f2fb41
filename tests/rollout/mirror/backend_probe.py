"""A stand-in drafter for draft hosts in other processes (importable there: no conftest imports)."""

import torch

from tailspec.draft_contract import DraftTree
from tailspec.kernels.dispatch import resolve_backend

BACKENDS = ("torch", "triton")


class BackendProbe:
    """Answers a branch call with one chain whose token says which attention backend a CUDA call
    would resolve to where it drafts (0: torch, 1: triton)."""

    def propose_branches(self, requests, shape):
        return [DraftTree.chain([BACKENDS.index(resolve_backend(torch.device("cuda"), kernel="attention"))], None)]
