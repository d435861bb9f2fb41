"""Projections that read the same input merged into one matrix for the engine's forwards
(``RolloutConfig.merge_projections``).

A decoder layer of a Hugging Face model multiplies its normed hidden states by three matrices
(``q_proj``, ``k_proj``, ``v_proj``) and, in the MLP, by two (``gate_proj``, ``up_proj``): five
GEMMs where one GEMM over the stacked weights does (two launches instead of five per layer; at
batch 1 each is a matrix-vector product that reads its weights once, and small ones do not fill
the GPU). The model's own code is kept: while the engine runs the model, each projection of a group
has a ``forward`` of its own (an instance attribute, as the compiled layers swap theirs in) whose
first call on an input multiplies by the merged weights and keeps the other members' slices for
them; a member called on another input (a model that does not follow the convention) multiplies
by the merged weights again, so it is never wrong, only slower.

The merged weights are copies (the trainer's parameters stay what they are: an optimizer, DeepSpeed
and ``save_pretrained`` see no shared storage), so they cost memory (for Llama-shaped layers about
two thirds of the decoder's weights) and are refreshed, in place so captured CUDA graphs stay
valid, whenever a parameter they came from changed (an optimizer step, ``load_state_dict``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

GROUPS = (  # members of a decoder layer that read the same input, by the Hugging Face names
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


@dataclass
class MergedGroup:
    """Linear layers that read the same input, and their stacked weights (and biases), made at the
    first :meth:`refresh` (under ZeRO-3 the parameters are whole only while gathered for rollouts)."""

    members: list[torch.nn.Linear]
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    _pending: dict[int, torch.Tensor] = field(default_factory=dict)  # member -> its slice, until taken
    _input: torch.Tensor | None = None
    _fingerprint: tuple = ()

    @property
    def sizes(self) -> list[int]:
        return [m.out_features for m in self.members]

    @property
    def nbytes(self) -> int:
        first = self.members[0]
        return sum(self.sizes) * first.in_features * first.weight.element_size()

    def fingerprint(self) -> tuple:
        """Where the source parameters live, their shapes, and how often they were changed in place."""
        params = [p for m in self.members for p in (m.weight, m.bias) if p is not None]
        return tuple((p.data_ptr(), p._version, p.shape) for p in params)

    def refresh(self) -> bool:
        """Copy the sources into the merged tensors if any changed (in place, so a captured graph
        keeps reading them; made anew only when their shape changed); True if it copied."""
        now = self.fingerprint()
        if now == self._fingerprint:
            return False
        with torch.no_grad():
            weights, biases = [m.weight for m in self.members], [m.bias for m in self.members]
            if self.weight is None or self.weight.shape[0] != sum(w.shape[0] for w in weights):
                self.weight = torch.cat(weights)
                self.bias = torch.cat(biases) if biases[0] is not None else None
            else:
                torch.cat(weights, out=self.weight)
                if self.bias is not None:
                    torch.cat(biases, out=self.bias)
        self._fingerprint = now
        return True

    def forward_of(self, index: int):
        """Member ``index``'s forward: its slice of the merged product of its input."""

        def forward(x: torch.Tensor) -> torch.Tensor:
            if self._input is not x or index not in self._pending:
                parts = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
                self._input, self._pending = x, dict(enumerate(parts))
            out = self._pending.pop(index)
            if not self._pending:
                self._input = None  # nothing outlives the forward that made it
            return out

        return forward


class MergedProjections:
    """The merged groups of a model's decoder layers (``GROUPS``), made on construction."""

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self.groups: list[MergedGroup] = []
        skipped: set[str] = set()
        for layer in layers:
            for names in GROUPS:
                members = [_submodule(layer, name) for name in names]
                if _mergeable(members):
                    self.groups.append(MergedGroup(members))
                else:
                    skipped.add(f"{type(layer).__name__}: {', '.join(names)}")
        if skipped:
            logger.warning(
                "RolloutConfig.merge_projections: %s not merged (not plain nn.Linear layers of one input, dtype "
                "and device); those run as they are",
                "; ".join(sorted(skipped)),
            )
        self.nbytes = sum(g.nbytes for g in self.groups)
        logger.info("merge_projections: %d groups, %.1f MB of merged weights", len(self.groups), self.nbytes / 2**20)

    def forget(self) -> None:
        """Every group copies its sources again at the next refresh (``ModelRunner.weights_changed``)."""
        for group in self.groups:
            group._fingerprint = ()

    def data_ptrs(self) -> tuple[int, ...]:
        """Where the merged weights live (a captured graph reads them there)."""
        return tuple(t.data_ptr() for g in self.groups for t in (g.weight, g.bias) if t is not None)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within the block the members forward through their merged weights (refreshed first)."""
        for group in self.groups:
            group.refresh()
        for group in self.groups:
            for i, member in enumerate(group.members):
                member.forward = group.forward_of(i)
        try:
            yield
        finally:
            for group in self.groups:
                group._input, group._pending = None, {}
                for member in group.members:
                    vars(member).pop("forward", None)


def _submodule(layer: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _mergeable(members: list[torch.nn.Module | None]) -> bool:
    """Plain ``nn.Linear`` layers (no adapters, no hooks of their own) reading one input size, all
    with or all without a bias, of one dtype and device, none already swapped."""
    if not all(type(m) is torch.nn.Linear for m in members):
        return False
    first = members[0].weight
    return (
        len({m.in_features for m in members}) == 1
        and len({m.bias is None for m in members}) == 1
        and all(m.weight.dtype == first.dtype and m.weight.device == first.device for m in members)
        and not any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in members)
    )
