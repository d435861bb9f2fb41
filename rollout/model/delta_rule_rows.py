"""A verification forward through a Gated DeltaNet layer (Qwen3.5 dense and MoE, Qwen3-Next) in one
call: the layer's projections, short convolution, gates and output once over every row of every
sequence, and only the delta rule's recurrence row by row.

A verification's rows form a chain or a tree (``parents[s, r]``: row ``r``'s parent row, -1 for
row 0, the pending token, whose parent is the sequence's slot). Row ``r``'s convolution reads the
last ``K`` inputs on its path: itself, its ancestors, and past the root the slot's convolution
state; :func:`conv_windows` finds those columns on the device by walking the parents ``K - 1``
times (nothing read to the host). Its recurrence starts from its parent row's state (row 0 from the
slot's), so a rejected row's state never reaches a row that is not its descendant. Each row's
convolution window and recurrent state come back for :meth:`RecurrentStates.keep`.

The arithmetic is transformers' one-token decode step (``causal_conv1d_update`` and
``torch_recurrent_gated_delta_rule``) applied to many rows at once: each row's convolution is the
same grouped ``conv1d`` over the same ``K`` inputs, and its recurrence the same fp32 operations in
the same order. It replaces ``rows`` one-token calls of the whole layer (projections, convolution,
norm and output projection each ``rows`` times) with one of each and ``rows`` small recurrences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

# mixer class -> how its input projections give (mixed q/k/v before the convolution, z, b, a)
Projections = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _separate_projections(mixer, x: torch.Tensor):
    """Qwen3.5's: one projection each for q/k/v, the output gate z, beta's b and the decay's a."""
    z = mixer.in_proj_z(x)
    return mixer.in_proj_qkv(x), z.reshape(*z.shape[:-1], -1, mixer.head_v_dim), mixer.in_proj_b(x), mixer.in_proj_a(x)


def _interleaved_projections(mixer, x: torch.Tensor):
    """Qwen3-Next's: q/k/v/z and b/a projected together, grouped by key head (the layer's own reordering)."""
    query, key, value, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(x), mixer.in_proj_ba(x))
    mixed = torch.cat([t.reshape(*t.shape[:2], -1) for t in (query, key, value)], dim=-1)
    return mixed, z, b, a


ROW_VERIFIED: dict[str, Projections] = {
    "Qwen3_5GatedDeltaNet": _separate_projections,
    "Qwen3_5MoeGatedDeltaNet": _separate_projections,
    "Qwen3NextGatedDeltaNet": _interleaved_projections,
}


def conv_windows(parents: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[S, R, K]``: the columns of ``cat(slot's convolution state [K], the rows [R])`` that row ``r``'s
    convolution reads, oldest first. From a row (column ``K + r``) the column before it on the path is
    its parent's (``K + parents[r]``; the root's parent -1 lands on the state's last column) and from a
    state column ``c`` it is ``c - 1``."""
    num_seqs, rows = parents.shape
    column = kernel + torch.arange(rows, device=parents.device).expand(num_seqs, rows)
    columns = [column]
    for _ in range(kernel - 1):
        from_row = kernel + parents.gather(1, (column - kernel).clamp(min=0))
        column = torch.where(column >= kernel, from_row, column - 1)
        columns.append(column)
    return torch.stack(columns[::-1], dim=-1)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def verify_rows(
    mixer: torch.nn.Module,
    x: torch.Tensor,
    parents: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mixer`` over a verification's rows ``x`` (``[S, R, hidden]``) from each sequence's slot states
    (``conv_state [S, conv_dim, K]``, ``recurrent_state [S, heads, key, value]``): its output
    ``[S, R, hidden]``, and every row's convolution window ``[S, R, conv_dim, K]`` and recurrent
    state ``[S, R, heads, key, value]`` (fp32), the states after that row."""
    num_seqs, rows, _ = x.shape
    mixed, z, b, a = ROW_VERIFIED[type(mixer).__name__](mixer, x)
    kernel = conv_state.shape[-1]
    columns = torch.cat([conv_state.to(mixed.dtype), mixed.transpose(1, 2)], dim=-1)  # [S, C, K + R]
    index = conv_windows(parents, kernel).reshape(num_seqs, 1, rows * kernel).expand(-1, columns.shape[1], -1)
    windows = columns.gather(2, index).reshape(num_seqs, -1, rows, kernel).transpose(1, 2)  # [S, R, C, K]
    weight = mixer.conv1d.weight
    flat = windows.reshape(num_seqs * rows, -1, kernel).to(weight.dtype)
    conv = F.conv1d(flat, weight, mixer.conv1d.bias, groups=flat.shape[1])  # one output per row: [S*R, C, 1]
    conv = ACT2FN[mixer.activation](conv).to(x.dtype).reshape(num_seqs, rows, -1)
    query, key, value = torch.split(conv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    core, states = _delta_rule_rows(mixer, query, key, value, b, a, parents, recurrent_state)
    core = mixer.norm(core.to(x.dtype).reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(core.reshape(num_seqs, rows, -1)), windows, states


def _delta_rule_rows(mixer, query, key, value, b, a, parents, recurrent_state):
    """The gated delta rule, one row at a time from its parent row's state, every sequence at once:
    transformers' ``torch_recurrent_gated_delta_rule`` (fp32, q and k l2-normalised, q scaled)."""
    num_seqs, rows, _ = query.shape
    heads = mixer.num_v_heads
    query = query.reshape(num_seqs, rows, -1, mixer.head_k_dim)
    key = key.reshape(num_seqs, rows, -1, mixer.head_k_dim)
    value = value.reshape(num_seqs, rows, heads, mixer.head_v_dim).float()
    if query.shape[2] != heads:  # grouped values: each q/k head serves heads // num_k_heads value heads
        query = query.repeat_interleave(heads // query.shape[2], dim=2)
        key = key.repeat_interleave(heads // key.shape[2], dim=2)
    query = _l2norm(query.float())
    key = _l2norm(key.float())
    query = query / (query.shape[-1] ** 0.5)
    beta = b.sigmoid().float()
    decay = (-mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)).exp()
    states = recurrent_state.new_empty((num_seqs, rows, *recurrent_state.shape[1:]), dtype=torch.float32)
    core = value.new_empty((num_seqs, rows, heads, mixer.head_v_dim))
    seqs = torch.arange(num_seqs, device=query.device)
    for r in range(rows):
        # every row but the pending token descends from it: its parent is an earlier row (padding: row 0)
        state = recurrent_state.float() if r == 0 else states[seqs, parents[:, r].clamp(min=0)]
        state = state * decay[:, r, :, None, None]
        k, q = key[:, r], query[:, r]
        remembered = (state * k.unsqueeze(-1)).sum(dim=-2)
        delta = (value[:, r] - remembered) * beta[:, r].unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        states[:, r] = state
        core[:, r] = (state * q.unsqueeze(-1)).sum(dim=-2)
    return core, states
