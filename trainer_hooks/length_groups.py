"""Trainer forwards grouped by completion length, so that padding costs no compute.

TRL right-pads every completion of a batch to the longest one and runs each policy forward (the
loss forward, and the no-grad old-/reference-logprob forwards) on that rectangle. A long-tail
rollout batch is mostly short rows plus a few long ones, so most of that rectangle is padding:
one 337-token completion among 31 of ~20 tokens makes the forward ~10x the real work.

:func:`plan_length_groups` splits the rows into groups of similar length (an optimal contiguous
partition of the rows sorted by length, trading padding against a fixed cost per forward call);
:func:`forward_by_length` runs the forward once per group, each trimmed on the right to its own
longest completion, and puts the outputs back in the batch's order and width.

Nothing changes what is learned: in a causal model a position never sees the columns to its right,
and every row is computed independently of the others, so the kept positions get the same values
(up to the float rounding of differently shaped kernels). The positions cut off hold padding,
which every consumer of these outputs masks; they come back as zeros. The left (prompt) side is
not trimmed: without explicit position ids that would shift the positions of the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

# (input_ids, attention_mask, logits_to_keep) -> per-position outputs, each (rows, logits_to_keep) or None
GroupForward = Callable[[torch.Tensor, torch.Tensor, int], Sequence[torch.Tensor | None]]


def completion_lengths(attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Per row, the number of completion columns up to and including its last attended one."""
    completion = attention_mask[:, attention_mask.size(1) - logits_to_keep :]
    columns = torch.arange(1, logits_to_keep + 1, device=attention_mask.device)
    return (completion.ne(0) * columns).amax(dim=1)


def plan_length_groups(lengths: Sequence[int], prompt_width: int, overhead_tokens: int) -> list[list[int]]:
    """Row indices grouped so that ``sum(len(group) * (prompt_width + longest in group))`` plus
    ``overhead_tokens`` per group is minimal, among partitions into runs of the rows sorted by
    length (where an optimal one lies). Each group lists its rows by increasing length."""
    if prompt_width < 0:
        raise ValueError(f"prompt_width must be >= 0, got {prompt_width}")
    if overhead_tokens < 0:
        raise ValueError(f"length_group_overhead_tokens must be >= 0, got {overhead_tokens}")
    order = sorted(range(len(lengths)), key=lambda row: lengths[row])
    widths = [prompt_width + max(1, int(lengths[row])) for row in order]
    # best[j]: the cost of the first j sorted rows; cut[j]: where the last of their groups starts
    best = [0.0] + [float("inf")] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        width = widths[end - 1]  # the longest of any group ending here
        for start in range(end):
            cost = best[start] + (end - start) * width + overhead_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = len(order)
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def forward_by_length(
    forward: GroupForward,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    overhead_tokens: int,
) -> list[torch.Tensor | None]:
    """``forward`` run per length group (see module docstring), its outputs reassembled to
    ``(rows, logits_to_keep)`` in the batch's row order; gradients flow through."""
    if logits_to_keep < 1:
        raise ValueError(f"logits_to_keep must be >= 1, got {logits_to_keep}")
    lengths = completion_lengths(attention_mask, logits_to_keep).clamp(min=1)
    prompt_width = input_ids.size(1) - logits_to_keep
    groups = plan_length_groups(lengths.tolist(), prompt_width, overhead_tokens)
    if len(groups) == 1 and int(lengths.max()) == logits_to_keep:
        return list(forward(input_ids, attention_mask, logits_to_keep))
    pieces: list[list[torch.Tensor | None]] = []
    for rows in groups:
        keep = int(lengths[rows].max())
        index = torch.tensor(rows, device=input_ids.device)
        width = prompt_width + keep
        outputs = forward(input_ids[index, :width], attention_mask[index, :width], keep)
        pieces.append([None if out is None else F.pad(out, (0, logits_to_keep - keep)) for out in outputs])
    order = torch.tensor([row for rows in groups for row in rows], device=input_ids.device)
    restore = torch.argsort(order)
    merged: list[torch.Tensor | None] = []
    for outputs in zip(*pieces):
        merged.append(None if outputs[0] is None else torch.cat(outputs, dim=0)[restore])
    return merged
