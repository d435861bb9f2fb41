"""The EAGLE-3 draft head: one decoder layer over fused low/mid/high target features.

Data flow for one draft row at position ``t`` (the EAGLE alignment):

* ``features[t]`` are the target's hidden states *entering* the layers ``aux_layer_ids`` while it
  processed token ``t`` (concatenated, ``len(aux_layer_ids) * target_hidden_size`` wide); ``fc``
  projects them to ``hidden_size``. In later draft steps the head's own output hidden state of
  the previous row is fed back instead (already ``hidden_size`` wide, no ``fc``).
* the token input is token ``t + 1`` (embedded with the *target's* embedding table);
* the layer attends over ``cat(input_layernorm(embed), hidden_norm(hidden))`` (``2 * hidden``
  wide) with RoPE at position ``t``, adds the residual (the hidden input), runs the MLP;
* ``norm`` + ``lm_head`` give logits over the draft vocabulary for token ``t + 2``;
  ``target_id = draft_id + d2t[draft_id]``, and ``t2d`` marks target ids the draft vocabulary
  holds.

Parameter names are those of the ``LlamaForCausalLMEagle3`` checkpoints SGLang and vLLM load
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so export is a key check, not
a rename. Attention is a callback: the engine passes a paged one, training a dense one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# attend(q, k, v) -> out: q [B, heads, T, D], k/v [B, kv_heads, T, D] (after RoPE) -> [B, T, heads, D]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Inputs to layers (2, L // 2, L - 3), the taps SGLang and vLLM use when none are configured."""
    return (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))


def _dense_mlp_size(fields: dict[str, Any]) -> int:
    """The MLP width of a head shaped like one target layer: the target's dense MLP, or where every
    layer is a mixture of experts (Qwen3.5-MoE, Qwen3-Next) its shared expert's, else one expert's."""
    for name in ("intermediate_size", "shared_expert_intermediate_size", "moe_intermediate_size"):
        if fields.get(name):
            return int(fields[name])
    raise ValueError("Eagle3Config.for_target: the target config names no MLP width (intermediate_size)")


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 head and of the target it drafts for.

    ``aux_layer_ids`` index the target layers whose *inputs* are tapped (0 = the embeddings,
    ``i`` = the output of layer ``i - 1``); exporters convert to each engine's convention.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict)  # carried through checkpoints untouched

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids) or default_aux_layer_ids(self.target_num_layers)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "target_hidden_size",
            "target_num_layers",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Eagle3Config.{name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.draft_vocab_size, int) and 1 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(
                f"Eagle3Config.draft_vocab_size must be an int in [1, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Eagle3Config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"Eagle3Config.aux_layer_ids must name 3 target layers, got {list(self.aux_layer_ids)}")
        for i in self.aux_layer_ids:
            if not 0 <= i < self.target_num_layers:
                raise ValueError(
                    f"Eagle3Config.aux_layer_ids entries must be in [0, target_num_layers={self.target_num_layers}), "
                    f"got {list(self.aux_layer_ids)}"
                )
        if self.hidden_act != "silu":
            raise ValueError(f"Eagle3Config.hidden_act must be 'silu', got {self.hidden_act!r}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("Eagle3Config.rms_norm_eps and rope_theta must be > 0")

    @property
    def feature_size(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        draft_vocab_size: int | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """A head shaped like one layer of the target (the usual EAGLE-3 choice)."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        heads = tc.num_attention_heads
        fields = tc.to_dict()  # not getattr: a per-layer field (Gemma 4's head_dim) raises there
        rope = getattr(tc, "rope_parameters", None) or {}
        values: dict[str, Any] = dict(
            hidden_size=tc.hidden_size,
            intermediate_size=_dense_mlp_size(fields),
            num_attention_heads=heads,
            num_key_value_heads=fields.get("num_key_value_heads") or heads,
            head_dim=fields.get("head_dim") or tc.hidden_size // heads,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size or tc.vocab_size,
            target_hidden_size=tc.hidden_size,
            target_num_layers=tc.num_hidden_layers,
            aux_layer_ids=tuple(aux_layer_ids or ()),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768)),
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Eagle3Config:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Eagle3Config field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**data)

    def target_problems(self, target_config: Any) -> list[str]:
        """What keeps this head from drafting for a target of ``target_config`` (its hidden size,
        vocabulary and layer count, which fix the tapped layers); empty when it fits."""
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return [
            f"EAGLE-3 head was made for a target with {what} {mine}, this target has {theirs}{why}"
            for mine, theirs, what, why in (
                (self.target_hidden_size, tc.hidden_size, "hidden size", ""),
                (self.vocab_size, tc.vocab_size, "vocabulary size", ""),
                (
                    self.target_num_layers,
                    tc.num_hidden_layers,
                    "number of layers",
                    f" (the head taps the inputs of layers {list(self.aux_layer_ids)})",
                ),
            )
            if mine != theirs
        ]

    def check_target(self, target_config: Any) -> None:
        """Refuse a target this head was not made for (hidden size, vocabulary, layer count)."""
        problems = self.target_problems(target_config)
        if problems:
            raise ValueError(problems[0])


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``cos``/``sin`` of shape ``[*positions.shape, head_dim]`` (the Llama half-rotation layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[B, heads, T, D]``; ``cos``/``sin`` are ``[B, T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = 0  # the paged attention function looks this up
        in_dim = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.reshape(b, t, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The ``midlayer``: attention over ``[norm(embed), norm(hidden)]``, residual from ``hidden``."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: AttendFn):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, positions, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """The trainable part of an EAGLE-3 drafter (the embedding table is the target's)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        self.version = 0  # weights version: bumped by every training step, saved in checkpoints
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        full_vocab = cfg.draft_vocab_size == cfg.vocab_size  # identity map; a reduced one is set from counts
        self.register_buffer("t2d", torch.full((cfg.vocab_size,), full_vocab, dtype=torch.bool))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (``feature_size`` wide) to the head's hidden size."""
        return self.fc(features.to(self.fc.weight.dtype))

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``embeds``/``hidden`` ``[B, T, H]``, ``positions`` ``[B, T]`` -> (hidden out ``[B, T, H]``,
        draft-vocabulary logits ``[B, T, draft_vocab]``). The hidden output feeds the next draft step."""
        out = self.midlayer(embeds, hidden, positions, attend)
        return out, self.lm_head(self.norm(out))

    # -- vocabulary mapping --------------------------------------------------------------
    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """Use the target ids ``draft_to_target`` (ascending, unique) as the draft vocabulary."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).flatten()
        n, v = self.config.draft_vocab_size, self.config.vocab_size
        if ids.numel() != n:
            raise ValueError(f"draft vocabulary needs {n} target ids, got {ids.numel()}")
        if ids.numel() and (ids.min() < 0 or ids.max() >= v or not bool((ids[1:] > ids[:-1]).all())):
            raise ValueError(f"draft vocabulary ids must be ascending, unique and in [0, {v})")
        self.d2t.copy_(ids - torch.arange(n))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Spread draft-vocabulary logits over the target vocabulary (``-inf`` off the draft vocabulary)."""
        if not self.reduced_vocab:
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy(-1, self.draft_to_target_ids(), draft_logits)

    def target_to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft id of each target id, -1 where the draft vocabulary does not hold it."""
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        lookup[self.draft_to_target_ids()] = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        return lookup[target_ids]


def vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent target ids (ties by id), ascending; ``always`` ids
    (e.g. EOS) are kept whatever their count."""
    counts = torch.as_tensor(counts, dtype=torch.float64).clone()
    if not 1 <= draft_vocab_size <= counts.numel():
        raise ValueError(f"draft_vocab_size must be in [1, {counts.numel()}], got {draft_vocab_size}")
    for i in always:
        counts[i] = float("inf")
    order = sorted(range(counts.numel()), key=lambda i: (-counts[i].item(), i))
    return torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
