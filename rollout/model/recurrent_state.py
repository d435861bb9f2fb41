"""Recurrent state beside the paged cache: the Gated DeltaNet layers of Qwen3.5 (dense and MoE) and
Qwen3-Next (three of every four decoder layers by default), Kimi-Linear's KDA layers, and the Mamba-2
mixers of Nemotron-H and Falcon-H1 (beside attention in every Falcon-H1 layer).

Such a layer carries two tensors from one forward to the next: a short convolution's last ``K``
inputs (``[conv_dim, K]``) and its recurrence's state (the delta rule's ``[heads, key size, value
size]``, fp32; Mamba-2's SSM state ``[heads, head size, state size]``). Transformers keeps them in
its ``Cache`` for a padded batch; the engine packs every sequence's new tokens into one row, so
here each running sequence holds one *slot* of every such layer's state (:class:`RecurrentStates`:
allocated when the scheduler starts it, freed when it stops running: finished, aborted, handed over
or preempted), and the layer runs once per sequence's segment of the packed row from that
sequence's slot (:func:`recurrent_state_enabled`).
One sequence's state never sees another's tokens.

The layer's own ``forward`` does the arithmetic (its projections, its convolution, transformers'
torch delta rule: chunked over a segment of several tokens, recurrent over one), handed a cache
that reads and writes the segment's slot (:class:`SlotCache`), so the engine computes what
transformers computes for one sequence. A segment that starts a sequence (nothing cached) starts
from zero state whatever its slot held, which is what makes a recompute after preemption or a
handed-over request exact. Segments of one new token each (a decode step) run as one batch: their
slots gathered, run, and scattered back. Slot 0 is scratch (padding rows, calibration's forwards).

**Speculation rolls the state back.** A verification forward (its slices name each row's parent
row: a chain's row before it, a tree node's parent, row 0 the pending token) runs a Gated DeltaNet
layer in one call (``delta_rule_rows.py``: projections and convolutions once, the delta rule row by
row) and any other mixer one row at a time, every sequence's ``r``-th row as one batch; each row
starts from its parent row's state (row 0 from the slot's), and every row's state is held
(``RecurrentStates.rows``). Once the verification knows
what it kept, :meth:`RecurrentStates.keep` writes each slot the state after its last kept token:
on the host for a step drafted from the host's text (``host_step.py``), on the device, from the
device's accept lengths and paths with nothing read, for a step launched from the device's state
(``spec/device_step.py``). A rejected draft's state never reaches a slot, trees included, and a
kept row's state is the one plain decoding leaves (one token a call is transformers' decode step).
Cost: a Gated DeltaNet layer's one call and ``rows`` small recurrences; another mixer's ``depth + 1``
(a chain) or ``n + 1`` (a tree of ``n`` nodes) one-token calls instead of one; every row's state held
until the keep: ``rows`` times a slot's size per sequence.

**Captured graphs** replay one-token steps (:func:`replayable`): a bucket's rows name their slots in
an input (padding rows slot 0, scratch; :func:`padded_slots`), and the layer runs one batched call
from the gathered states, written back, every index on the device. A capture's warm-up runs the
forward, so the pool keeps the bucket's slots' states across it (:func:`slots_preserved`) and the
replay that follows advances them once. Verifications through Gated DeltaNet layers replay too
(:func:`padded_verification_inputs`: each row's parent an input; the rows' states copied into the
bucket's buffers, which :meth:`RecurrentStates.replayed` hands to the keep, since a replay runs no
Python); prefills, and verifications through other mixers (row by row), run uncaptured.

Not served (refused by name): prefix caching (a cached prefix has K/V but no state) and a drafter
LM with such layers (``self:L`` of a hybrid policy included).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ...kernels.transfers import to_device
from .delta_rule_rows import ROW_VERIFIED, verify_rows
from .state_slots import RecurrentStates, RowCache, SlotCache

# the token mixers served here: transformers' classes that keep their state through the same cache calls
# (get/update conv and recurrent state; a one-token call from a state, several from the chunked form)
RECURRENT_MIXERS = frozenset(
    {
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet",
        "Qwen3NextGatedDeltaNet",
        "KimiLinearDeltaAttention",
        "NemotronHMamba2Mixer",
        "FalconH1Mixer",
    }
)


def recurrent_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s token mixers that keep a recurrent state served here, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in RECURRENT_MIXERS]


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a packed forward: its state slot, the tokens it had cached before the
    forward, and its rows ``start .. start + num_new - 1`` of the packed row."""

    slot: int
    num_cached: int
    start: int
    num_new: int


@contextmanager
def recurrent_state_enabled(model: torch.nn.Module, states: RecurrentStates) -> Iterator[None]:
    """Within the block, ``model``'s recurrent layers run each packed forward's sequences from
    their slots of ``states`` (a forward without the engine's segments runs as transformers wrote it)."""
    mixers = recurrent_mixers(model)
    for mixer in mixers:
        mixer.forward = partial(_segmented_forward, mixer, type(mixer).forward, states)
    try:
        yield
    finally:
        for mixer in mixers:
            del mixer.forward


def _segmented_forward(mixer, original, states: RecurrentStates, hidden_states: torch.Tensor, *args, **kwargs):
    from .attention import METADATA_KWARG  # the packed forward's metadata names its segments

    meta = kwargs.pop(METADATA_KWARG, None)
    segments = meta.segments if meta is not None else None
    if meta is not None and meta.state_slots is not None:
        kwargs.pop("cache_params", None)
        kwargs.pop("attention_mask", None)
        if meta.draft_rows is not None:
            return _padded_verification(mixer, states, hidden_states, meta.state_slots, meta.draft_rows)
        return _padded_one_token(mixer, original, states, hidden_states, meta.state_slots, kwargs)
    if not segments:
        return original(mixer, hidden_states, *args, **kwargs)
    kwargs.pop("cache_params", None)
    kwargs.pop("attention_mask", None)
    if meta.draft_rows is not None and type(mixer).__name__ in ROW_VERIFIED:
        return _verification_in_one_call(mixer, states, hidden_states, segments, meta.draft_rows)
    if meta.draft_rows is not None:
        return _verification_rows(mixer, original, states, hidden_states, segments, meta.draft_rows, kwargs)
    layer, out = mixer.layer_idx, torch.empty_like(hidden_states)
    steps = [s for s in segments if s.num_new == 1 and s.num_cached > 0 and s.slot > 0]
    if steps:  # one token each from a state: one batched call
        rows = torch.tensor([s.start for s in steps], device=hidden_states.device)
        cache = SlotCache(states, layer, [s.slot for s in steps], fresh=False)
        batch = hidden_states[0].index_select(0, rows).unsqueeze(1)  # [n, 1, hidden]
        out[0].index_copy_(0, rows, original(mixer, batch, cache_params=cache, **kwargs)[:, 0])
        cache.written_in_place()
    for s in segments:
        if s.num_new == 1 and s.num_cached > 0 and s.slot > 0:
            continue
        cache = SlotCache(states, layer, [s.slot], fresh=s.num_cached == 0 or s.slot == 0)  # scratch: no state
        part = hidden_states[:, s.start : s.start + s.num_new]
        out[:, s.start : s.start + s.num_new] = original(mixer, part, cache_params=cache, **kwargs)
        cache.written_in_place()
    return out


def _padded_one_token(mixer, original, states: RecurrentStates, hidden_states, slots: torch.Tensor, kwargs):
    """A captured bucket's one-token forward (``[1, B, hidden]``, row ``i`` one token of the sequence
    holding ``slots[i]``; padding rows slot 0, scratch): one batched call from the gathered states,
    written back, every index on the device, so a CUDA graph replays it."""
    cache = SlotCache(states, mixer.layer_idx, slots, fresh=False)
    out = original(mixer, hidden_states.transpose(0, 1), cache_params=cache, **kwargs)  # [B, 1, hidden]
    cache.written_in_place()
    return out.transpose(0, 1)


def replayable(slices) -> bool:
    """Whether a packed forward of ``slices`` may be padded to a captured bucket on a recurrent
    model: one token each, from a state (a decode step). Prefills and verifications, whose rows
    start states or hold each row's, run uncaptured."""
    return all(s.num_new == 1 and s.num_cached > 0 and s.draft_parents is None for s in slices)


def padded_slots(slices, batch: int) -> torch.Tensor:
    """``[batch]`` on the host: each sequence's state slot, then slot 0 (scratch) for padding rows."""
    slots = torch.zeros(batch, dtype=torch.long)
    slots[: len(slices)] = torch.tensor([s.state_slot for s in slices], dtype=torch.long)
    return slots


def _padded_verification(mixer, states: RecurrentStates, hidden_states, slots: torch.Tensor, parents: torch.Tensor):
    """A captured bucket's verification (``[1, B * R, hidden]``, sequence ``i``'s rows at ``i * R``,
    ``parents [B, R]``) through a Gated DeltaNet layer in one call, every index on the device; its row
    states copied into the bucket's buffers (made at its first, uncaptured run), which every replay
    rewrites and :meth:`RecurrentStates.replayed` hands to the keep."""
    layer, (batch, rows) = mixer.layer_idx, parents.shape
    conv, recurrent = states.conv[layer], states.recurrent[layer]
    x = hidden_states[0].view(batch, rows, -1)
    out, windows, row_states = verify_rows(mixer, x, parents, conv[slots], recurrent[slots])
    buffers = states.bucket_rows.setdefault((batch, rows), {})
    if layer not in buffers:
        buffers[layer] = (torch.empty_like(windows), torch.empty_like(row_states))
    buffers[layer][0].copy_(windows)
    buffers[layer][1].copy_(row_states)
    states.rows[layer] = buffers[layer]
    return out.view(1, batch * rows, -1)


def padded_verification_inputs(slots, parents: torch.Tensor, batch: int, rows: int) -> dict[str, torch.Tensor]:
    """A captured verification's state inputs: each sequence's slot (padding sequences slot 0) and
    its rows' parents ``[batch, rows]`` (-1 past its rows: they start from the slot, never read)."""
    padded = parents.new_full((batch, rows), -1)
    padded[: parents.shape[0], : parents.shape[1]] = parents
    state_slots = np.zeros(batch, dtype=np.int64)
    state_slots[: len(slots)] = list(slots)
    return {"state_slots": to_device(state_slots, parents.device), "state_parents": padded}  # queued, no wait


@contextmanager
def slots_preserved(states: RecurrentStates, inputs: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, whatever runs may advance the states of the slots a captured bucket's
    ``inputs`` name (a CUDA graph's capture runs its forward for warm-up): after it they hold what
    they held before, so the replay that follows advances them once."""
    tables = (*states.conv.values(), *states.recurrent.values())
    slots = inputs.get("state_slots")
    saved = [] if slots is None else [(t, t[slots.to(t.device)].clone()) for t in tables]
    try:
        yield
    finally:
        for table, before in saved:
            table[slots.to(table.device)] = before


def segments_of(slices, device: torch.device) -> tuple[tuple[Segment, ...], torch.Tensor | None]:
    """Each sequence's :class:`Segment` of a packed forward of ``slices`` (``SequenceSlice``s, in
    order), and for a verification forward (slices with ``draft_parents``) each row's parent row
    ``[S, R]`` (-1: the slot's state; past a sequence's rows, -1)."""
    out, start = [], 0
    for s in slices:
        out.append(Segment(s.state_slot, s.num_cached, start, s.num_new))
        start += s.num_new
    if slices[0].draft_parents is None:
        return tuple(out), None
    rows = max(s.num_new for s in slices)
    parents = [list(s.draft_parents) + [-1] * (rows - len(s.draft_parents)) for s in slices]
    return tuple(out), torch.tensor(parents, dtype=torch.long, device=device)


def verification_segments(slots, new: int, tree, device: torch.device) -> tuple[tuple[Segment, ...], torch.Tensor]:
    """The segments of a verification forward launched from the device's state (``new`` rows a
    sequence, a chain's or ``tree``'s: a ``TreeRows``), and each row's parent row, found on the
    device from the tree's visibility (its deepest visible row before it)."""
    segments = tuple(Segment(slot, 1, i * new, new) for i, slot in enumerate(slots))
    rows = torch.arange(new, device=device)
    if tree is None:
        parents = (rows - 1).expand(len(slots), new)
    else:
        before = tree.visible & (rows.unsqueeze(0) < rows.unsqueeze(1))  # [1 or B, new, new]: j < r, seen by r
        parents = torch.where(before, rows, -1).amax(dim=-1).expand(len(slots), new)
    return segments, parents


def refuse_what_state_cannot_serve(states: RecurrentStates | None, prefix_caching: bool) -> None:
    """Refuse, by name, what a model with recurrent state would decode wrong: prefix caching."""
    if states is not None and prefix_caching:
        raise ValueError(
            "prefix_caching: the model's recurrent layers (Gated DeltaNet, KDA, Mamba-2) keep a state, which a "
            "cached prefix does not hold; use prefix_caching=False"
        )


def _verification_rows(mixer, original, states, hidden_states, segments, parents: torch.Tensor, kwargs):
    """A verification forward: row by row (``r``-th rows of every sequence as one batch), each row one
    token from its parent row's state (row 0 from the slot's), every row's state held in
    ``states.rows`` until the verification keeps one (:meth:`RecurrentStates.keep`): a rejected
    draft's state never reaches the slot. One token a call is transformers' own decode step, so a
    kept row's state is what plain decoding would have left."""
    layer, device = mixer.layer_idx, hidden_states.device
    out = torch.empty_like(hidden_states)
    slots = torch.tensor([s.slot for s in segments], device=device)
    rows_of = max(s.num_new for s in segments)
    conv_rows = rec_rows = None
    for r in range(rows_of):
        active = [i for i, s in enumerate(segments) if s.num_new > r]
        index = torch.tensor(active, device=device)
        packed = torch.tensor([segments[i].start + r for i in active], device=device)
        if r == 0:
            conv = states.conv[layer][slots[index].to(states.conv[layer].device)]
            recurrent = states.recurrent[layer][slots[index].to(states.recurrent[layer].device)]
        else:
            parent = parents[index, r].to(conv_rows.device)
            conv, recurrent = conv_rows[index, parent], rec_rows[index, parent]
        cache = RowCache(conv, recurrent)
        x = hidden_states[0].index_select(0, packed).unsqueeze(1)  # [active, 1, hidden]
        out[0].index_copy_(0, packed, original(mixer, x, cache_params=cache, **kwargs)[:, 0])
        if conv_rows is None:
            conv_rows = conv.new_zeros((len(segments), rows_of, *conv.shape[1:]))
            rec_rows = cache.recurrent.new_zeros((len(segments), rows_of, *cache.recurrent.shape[1:]))
        conv_rows[index, r] = cache.conv
        rec_rows[index, r] = cache.recurrent.to(rec_rows.dtype)
    states.rows[layer] = (conv_rows, rec_rows)
    return out


def _verification_in_one_call(mixer, states: RecurrentStates, hidden_states, segments, parents: torch.Tensor):
    """A verification forward through a Gated DeltaNet layer (``delta_rule_rows.py``): every row's
    projections and convolution in one call, the recurrence row by row, every row's state held."""
    layer, device = mixer.layer_idx, hidden_states.device
    rows = parents.shape[1]
    offsets = torch.arange(rows, device=device)
    starts = torch.tensor([s.start for s in segments], device=device)
    last = torch.tensor([s.start + s.num_new - 1 for s in segments], device=device)
    packed = torch.minimum(starts[:, None] + offsets, last[:, None])  # [S, R]: rows past a sequence's repeat its last
    slots = torch.tensor([s.slot for s in segments], device=device)
    conv, recurrent = states.conv[layer], states.recurrent[layer]
    out_rows, conv_rows, rec_rows = verify_rows(
        mixer, hidden_states[0][packed], parents, conv[slots.to(conv.device)], recurrent[slots.to(recurrent.device)]
    )
    states.rows[layer] = (conv_rows, rec_rows)
    out = torch.empty_like(hidden_states)
    valid = offsets < torch.tensor([s.num_new for s in segments], device=device)[:, None]
    out[0, packed[valid]] = out_rows[valid]
    return out
