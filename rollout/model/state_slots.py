"""Each running sequence's slot of a recurrent model's state (:class:`RecurrentStates`), and the
cache a recurrent layer's own ``forward`` is handed inside the engine: what transformers' ``Cache``
answers for a Gated DeltaNet, KDA or Mamba-2 layer (its convolution and recurrent state, their
updates), answered from a sequence's slot (:class:`SlotCache`) or from a verification row's parent
state (:class:`RowCache`). How the layers use them: ``recurrent_state.py``."""

from __future__ import annotations

import torch


class RecurrentStates:
    """``num_slots`` slots of every recurrent layer's state (slot 0 scratch), each layer's tensors
    made at its first write, in the dtype and shape the layer hands over."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"recurrent state needs at least 2 slots (one scratch), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [slots, conv_dim, K]
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [slots, heads, key size, value size]
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> a verification's row states
        # a captured verification's row states, per bucket (batch, rows): buffers its replays write
        self.bucket_rows: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.verifications_replayable = False  # every recurrent layer verifies in one call (delta_rule_rows)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"no recurrent state slot free ({self.num_slots - 1} sequences hold one each)")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 < slot < self.num_slots or slot in self._free:
            raise ValueError(f"recurrent state slot {slot} is not held")
        self._free.append(slot)

    def copy(self, source: int, target: int) -> None:
        """Slot ``target`` takes ``source``'s state (a prompt group's member after its leader's prefill)."""
        for states in (*self.conv.values(), *self.recurrent.values()):
            states[target].copy_(states[source])

    def bytes_per_slot(self) -> int:
        """What one sequence's state takes, every layer's (after each layer's first write)."""
        tensors = (*self.conv.values(), *self.recurrent.values())
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def keep(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """After a verification forward (each of its rows' states held, :func:`_verification_rows`):
        slot ``slots[i]`` takes the state after its sequence's row ``rows[i]`` (the last token the
        verification kept: row 0 the pending token, row j + 1 draft node j), on the device."""
        for layer, (conv_rows, rec_rows) in self.rows.items():
            pick = torch.arange(len(slots), device=conv_rows.device)
            at = rows.to(conv_rows.device)
            self.conv[layer][slots.to(conv_rows.device)] = conv_rows[pick, at]
            self.recurrent[layer][slots.to(rec_rows.device)] = rec_rows[pick, at].to(self.recurrent[layer].dtype)
        self.rows.clear()

    def replayed(self, batch: int, rows: int) -> None:
        """After a captured verification's replay: its row states are in the bucket's buffers."""
        self.rows = dict(self.bucket_rows[(batch, rows)])

    def store(self, table: dict[int, torch.Tensor], layer: int, slots: torch.Tensor, value: torch.Tensor) -> None:
        if layer not in table:
            table[layer] = value.new_zeros((self.num_slots, *value.shape[1:]))
        table[layer][slots] = value.to(table[layer].dtype)


class _OlderCacheCalls:
    """The cache calls transformers made before 5.23 as well (the GPU image's 5.17 reads
    ``has_previous_state`` and the states through ``layers[i]``), answered from the same states."""

    def has_previous_state(self, layer_idx: int, state_idx: int = 0) -> bool:
        return self.get_conv_state(layer_idx) is not None

    @property
    def layers(self) -> _LayerStates:
        return _LayerStates(self)


class _LayerStates:
    """``cache.layers[i]`` as an older transformers reads it: ``conv_states[0]``, ``recurrent_states[0]``."""

    record_past = False

    def __init__(self, cache) -> None:
        self.cache = cache

    def __getitem__(self, layer_idx: int) -> _LayerStates:
        self.layer_idx = layer_idx
        return self

    @property
    def conv_states(self) -> list[torch.Tensor | None]:
        return [self.cache.get_conv_state(self.layer_idx)]

    @property
    def recurrent_states(self) -> list[torch.Tensor | None]:
        return [self.cache.get_recurrent_state(self.layer_idx)]


class SlotCache(_OlderCacheCalls):
    """What a Gated DeltaNet layer's ``forward`` asks of transformers' ``Cache``, answered from the
    slots of one call's sequences (a batch of one-token segments, or one segment): their states
    before the call (None where a sequence starts here), and their updates written back."""

    def __init__(self, states: RecurrentStates, layer: int, slots: list[int] | torch.Tensor, fresh: bool) -> None:
        self.states, self.layer, self.fresh = states, layer, fresh
        self.slots = slots if isinstance(slots, torch.Tensor) else torch.tensor(slots, dtype=torch.long)
        self.conv_kernel_size: int | None = None
        self._conv: torch.Tensor | None = None  # the gathered states a layer may update in place
        self._recurrent: torch.Tensor | None = None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.fresh:
            return None
        self._conv = self._gathered_conv()
        return self._conv

    def _gathered_conv(self) -> torch.Tensor:
        table = self.states.conv[self.layer]
        return table[self.slots.to(table.device)]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.fresh:
            return None
        table = self.states.recurrent[self.layer]
        self._recurrent = table[self.slots.to(table.device)]
        return self._recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """As transformers' ``LinearAttentionLayer``: a sequence's first inputs padded to the kernel,
        later ones after the state; the last ``K`` columns kept, the whole returned."""
        kernel = kwargs.get("conv_kernel_size") or conv_states.shape[-1]
        if self.fresh:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self._gathered_conv(), conv_states], dim=-1)
        self._store_conv(full[..., -kernel:])
        self._conv = None  # stored: nothing is updated in place after this
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.states.store(self.states.recurrent, self.layer, self.slots.to(recurrent_states.device), recurrent_states)
        self._recurrent = None  # stored: nothing is updated in place after this
        return recurrent_states

    def written_in_place(self) -> None:
        """A one-token call updates the gathered states in place (transformers' ``causal_conv1d_update``;
        Mamba-2's ``selective_state_update`` its SSM state, which it never hands back): write them back."""
        if self._conv is not None:
            self._store_conv(self._conv)
        if self._recurrent is not None:
            table = self.states.recurrent[self.layer]
            self.states.store(self.states.recurrent, self.layer, self.slots.to(table.device), self._recurrent)

    def _store_conv(self, value: torch.Tensor) -> None:
        self.states.store(self.states.conv, self.layer, self.slots.to(value.device), value)


class RowCache(_OlderCacheCalls):
    """A one-token call's cache for a verification row: the states it starts from (its parent
    row's, or its sequence's slot's), and the states after it, kept for :meth:`RecurrentStates.keep`."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent  # the layer updates ``conv`` in place

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.recurrent = recurrent_states
        return recurrent_states
