"""Grow a Llama-family policy in width and depth without changing the function it computes.

Used to put a shipped policy at a realistic size on a GPU with no model hub (``make gpu-check``):
the grown model costs what a model of its size costs, and its drafters keep their real
acceptance on it because its outputs are the original's.

Why the function is unchanged (hidden ``H -> H'``, heads of the same ``head_dim``):
- the residual stream's new coordinates stay zero: the embeddings' new columns are zero and every
  write into the stream (``o_proj``, ``down_proj``) has zero rows there;
- new attention heads and MLP units write nothing: their columns of ``o_proj`` / ``down_proj`` are
  zero (their other weights are random, so they cost real arithmetic on real-looking data);
- RMSNorm over ``H'`` coordinates, ``H' - H`` of them zero, divides by ``sqrt(H / H')`` times the
  old RMS when ``eps`` is scaled by ``H / H'``; the norm weights are scaled by ``sqrt(H / H')``;
- query head ``j`` keeps key/value head ``j // group``: old heads come first, the group size stays;
- added layers have zero ``o_proj`` and ``down_proj``: they add nothing to the stream.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import AutoModelForCausalLM

# (module path inside a decoder layer, which of its dims read the residual stream)
_READS_STREAM = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_WRITES_STREAM = ("self_attn.o_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def grown_config(config, hidden_size: int, intermediate_size: int, num_layers: int):
    """The config of ``config``'s model grown to the given sizes (head size and GQA group kept)."""
    old_h, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or old_h // heads
    if heads * head_dim != old_h:
        raise ValueError("grow_policy needs hidden_size == num_attention_heads * head_dim")
    if hidden_size < old_h or hidden_size % head_dim:
        raise ValueError(f"hidden_size must be a multiple of head_dim {head_dim} and >= {old_h}, got {hidden_size}")
    new_heads = hidden_size // head_dim
    group = heads // kv_heads
    if new_heads % group:
        raise ValueError(f"hidden_size / head_dim ({new_heads} heads) must be a multiple of the GQA group {group}")
    if intermediate_size < config.intermediate_size:
        raise ValueError(f"intermediate_size must be >= {config.intermediate_size}, got {intermediate_size}")
    if num_layers < config.num_hidden_layers:
        raise ValueError(f"num_layers must be >= {config.num_hidden_layers}, got {num_layers}")
    cfg = copy.deepcopy(config)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden_size, intermediate_size, num_layers
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = new_heads, new_heads // group, head_dim
    cfg.rms_norm_eps = config.rms_norm_eps * old_h / hidden_size
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [config.layer_types[0]] * num_layers
    if hasattr(cfg, "max_window_layers"):
        cfg.max_window_layers = num_layers
    return cfg


def kept_layer_positions(old_layers: int, new_layers: int) -> list[int]:
    """Where the original layers sit in the grown stack (evenly spread; the rest write nothing)."""
    return [round(i * new_layers / old_layers) for i in range(old_layers)]


def _put(grown: torch.nn.Module, name: str, value: torch.Tensor, zero_rest: bool) -> None:
    """Copy ``value`` into the top-left block of ``grown``'s parameter ``name``; zero the rest if asked."""
    target = grown.get_parameter(name)
    if zero_rest:
        target.zero_()
    target[tuple(slice(0, n) for n in value.shape)] = value.to(target.device, target.dtype)


def _zero_writes(grown: torch.nn.Module, prefix: str, value_of: dict[str, torch.Tensor] | None) -> None:
    """The layer's projections that write to the residual stream: zero, or ``value_of``'s padded with zeros."""
    for proj in _WRITES_STREAM:
        name = f"{prefix}.{proj}.weight"
        grown.get_parameter(name).zero_()
        if value_of is not None:
            _put(grown, name, value_of[name], zero_rest=True)
        bias = f"{prefix}.{proj}.bias"
        if bias in dict(grown.named_parameters()):
            grown.get_parameter(bias).zero_()
            if value_of is not None:
                _put(grown, bias, value_of[bias], zero_rest=True)


def _copy_layer(grown: torch.nn.Module, prefix: str, renamed: dict[str, torch.Tensor], scale: float) -> None:
    """A kept layer's weights (``renamed`` to its new index) into ``grown``: what reads the stream,
    the norms rescaled, per-head norms as they are, what writes it padded with zeros."""
    for module in _READS_STREAM:
        _put(grown, f"{prefix}.{module}.weight", renamed[f"{prefix}.{module}.weight"], zero_rest=False)
        if f"{prefix}.{module}.bias" in renamed:
            _put(grown, f"{prefix}.{module}.bias", renamed[f"{prefix}.{module}.bias"], zero_rest=False)
    for norm in _NORMS:
        _put(grown, f"{prefix}.{norm}.weight", renamed[f"{prefix}.{norm}.weight"] * scale, zero_rest=False)
    for name, value in renamed.items():  # per-head norms (Qwen3's q_norm / k_norm) are copied as they are
        if ".q_norm." in name or ".k_norm." in name:
            _put(grown, name, value, zero_rest=True)
    _zero_writes(grown, prefix, renamed)


@torch.no_grad()
def grow_policy(
    model: torch.nn.Module,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """A model of the given sizes, built on ``device`` in ``dtype``, computing ``model``'s function
    (up to the rounding of the rescaled norm weights; see the module docstring)."""
    cfg = grown_config(model.config, hidden_size, intermediate_size, num_layers)
    old_h, new_h = model.config.hidden_size, hidden_size
    scale = math.sqrt(old_h / new_h)
    torch.manual_seed(seed)
    with torch.device(device):
        grown = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    old_state = model.state_dict()

    embed = "model.embed_tokens.weight"
    _put(grown, embed, old_state[embed], zero_rest=True)
    _put(grown, "model.norm.weight", old_state["model.norm.weight"] * scale, zero_rest=False)
    if not cfg.tie_word_embeddings:
        _put(grown, "lm_head.weight", old_state["lm_head.weight"], zero_rest=False)
    positions = kept_layer_positions(model.config.num_hidden_layers, num_layers)
    for new_index in range(num_layers):
        prefix = f"model.layers.{new_index}"
        if new_index not in positions:
            _zero_writes(grown, prefix, None)
            continue
        old_prefix = f"model.layers.{positions.index(new_index)}"
        renamed = {
            k.replace(old_prefix + ".", prefix + ".", 1): v
            for k, v in old_state.items()
            if k.startswith(old_prefix + ".")
        }
        _copy_layer(grown, prefix, renamed, scale)
    grown.generation_config = copy.deepcopy(model.generation_config)
    return grown.eval()
