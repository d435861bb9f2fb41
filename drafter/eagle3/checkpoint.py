"""EAGLE-3 checkpoints (tailspec's own, with optimizer state) and export to SGLang / vLLM.

A tailspec checkpoint is a directory: ``config.json`` (format, checkpoint version, the
:class:`Eagle3Config`, training step, weights version, metadata, the optimizer's non-tensor
state), ``model.safetensors`` (the head's state dict) and, when saved with one,
``optimizer.safetensors`` (the optimizer's tensors as ``state.{param}.{name}``).

An export is the ``LlamaForCausalLMEagle3`` layout both engines load: a flat Llama
``config.json`` with ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config`` and a
``model.safetensors`` of ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``.
The tapped-layer ids differ by one between the two engines (see :func:`engine_layer_ids`).
Every write goes to a temporary directory first and is renamed into place, so a crash never
leaves half a checkpoint; every read checks keys and shapes against :func:`expected_shapes`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .model import Eagle3Config, Eagle3Head

logger = logging.getLogger(__name__)

FORMAT = "tailspec-eagle3"
CHECKPOINT_VERSION = 1
EXPORT_FORMATS = ("sglang", "vllm")
EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Checkpoint:
    head: Eagle3Head
    step: int = 0
    version: int = 0
    optimizer_state: dict[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every key of the head's state dict with its shape: the one contract loader and exporter check."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "fc.weight": (h, cfg.feature_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def check_state_dict(tensors: dict[str, torch.Tensor], cfg: Eagle3Config, source: str) -> None:
    """Refuse missing, unexpected or mis-shaped keys, non-finite weights and a ``d2t`` that leaves the vocabulary."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(f"{source}: missing keys {missing}, unexpected keys {unexpected}")
    for key, shape in want.items():
        got = tuple(tensors[key].shape)
        if got != shape:
            raise ValueError(f"{source}: {key} has shape {list(got)}, expected {list(shape)}")
        if tensors[key].is_floating_point() and not bool(torch.isfinite(tensors[key]).all()):
            raise ValueError(f"{source}: {key} holds NaN or inf values")
    targets = torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long().cpu()
    if cfg.draft_vocab_size and (targets.min() < 0 or targets.max() >= cfg.vocab_size):
        raise ValueError(f"{source}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")


# -- atomic writes -----------------------------------------------------------------------
def _write_dir_atomically(path: Path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _cpu_contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _read_safetensors(path: Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        return load_file(str(path), device=str(map_location))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is corrupted or not a safetensors file: {e}") from e


# -- tailspec checkpoints ----------------------------------------------------------------
def _split_optimizer(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"state.{index}.{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value.item() if isinstance(value, torch.Tensor) else value
    meta = {"param_groups": state["param_groups"], "scalars": scalars}
    return meta, tensors


def _join_optimizer(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, entry in meta.get("scalars", {}).items():
        for name, value in entry.items():
            # AdamW keeps its step count as a 0-d float tensor; restore that type
            state.setdefault(int(index), {})[name] = torch.tensor(float(value)) if name == "step" else value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    path: str | Path,
    head: Eagle3Head,
    *,
    step: int = 0,
    version: int = 0,
    optimizer_state: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a tailspec checkpoint directory (atomically)."""
    check_state_dict(head.state_dict(), head.config, "head")
    config: dict[str, Any] = {
        "format": FORMAT,
        "checkpoint_version": CHECKPOINT_VERSION,
        "eagle3_config": head.config.to_dict(),
        "step": int(step),
        "version": int(version),
        "metadata": metadata or {},
    }
    opt_tensors: dict[str, torch.Tensor] = {}
    if optimizer_state is not None:
        config["optimizer"], opt_tensors = _split_optimizer(optimizer_state)

    def write(tmp: Path) -> None:
        save_file(_cpu_contiguous(head.state_dict()), str(tmp / "model.safetensors"))
        if optimizer_state is not None:
            save_file(_cpu_contiguous(opt_tensors), str(tmp / "optimizer.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))

    out = _write_dir_atomically(Path(path), write)
    logger.info("saved EAGLE-3 checkpoint (step %d, version %d) to %s", step, version, out)
    return out


def load_checkpoint(
    path: str | Path, *, target_config: Any | None = None, map_location: str | torch.device = "cpu"
) -> Eagle3Checkpoint:
    """Read a tailspec checkpoint, refusing anything incomplete, corrupted or made for another target."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"EAGLE-3 checkpoint directory {path} does not exist")
    config = _read_json(path / "config.json")
    if config.get("format") != FORMAT:
        raise ValueError(
            f"{path / 'config.json'} is not a tailspec EAGLE-3 checkpoint (format {config.get('format')!r})"
        )
    version = config.get("checkpoint_version")
    if not isinstance(version, int) or version > CHECKPOINT_VERSION:
        raise ValueError(
            f"{path} has checkpoint_version {version!r}; this tailspec reads versions up to {CHECKPOINT_VERSION}"
        )
    cfg = Eagle3Config.from_dict(config["eagle3_config"])
    if target_config is not None:
        cfg.check_target(target_config)
    tensors = _read_safetensors(path / "model.safetensors", map_location)
    check_state_dict(tensors, cfg, str(path / "model.safetensors"))
    head = Eagle3Head(cfg)
    head.load_state_dict(tensors)
    head.to(tensors["fc.weight"].dtype)
    optimizer_state = None
    if "optimizer" in config:
        opt_tensors = _read_safetensors(path / "optimizer.safetensors", map_location)
        optimizer_state = _join_optimizer(config["optimizer"], opt_tensors)
    head.version = int(config.get("version", 0))
    return Eagle3Checkpoint(head, int(config.get("step", 0)), head.version, optimizer_state, config.get("metadata", {}))


# -- SGLang / vLLM export ----------------------------------------------------------------
def engine_layer_ids(aux_layer_ids: tuple[int, ...], fmt: str) -> list[int]:
    """Our ids name the layer whose *input* is tapped. vLLM (``llama.py``: ``if idx in
    self.aux_hidden_state_layers`` before running layer ``idx``) uses the same meaning; SGLang
    (``set_eagle3_layers_to_capture``: ``[val + 1 for val in layer_ids]``) adds one to configured
    ids, so it is given ``id - 1``, and cannot tap the embeddings (id 0)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if fmt == "vllm":
        return list(aux_layer_ids)
    if 0 in aux_layer_ids:
        raise ValueError(
            "SGLang cannot tap the embeddings (aux layer id 0); choose layer ids >= 1 for an SGLang export"
        )
    return [i - 1 for i in aux_layer_ids]


def _from_engine_layer_ids(ids: list[int], fmt: str) -> tuple[int, ...]:
    return tuple(i + 1 for i in ids) if fmt == "sglang" else tuple(ids)


def export_config(cfg: Eagle3Config, fmt: str, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": [EXPORT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": engine_layer_ids(cfg.aux_layer_ids, fmt),
            "use_aux_hidden_state": True,
        },
    }


def export_checkpoint(head: Eagle3Head, out_dir: str | Path, *, format: str, dtype: torch.dtype | None = None) -> Path:
    """Write the ``LlamaForCausalLMEagle3`` layout for ``format`` ("sglang" or "vllm")."""
    cfg = head.config
    layer_ids = engine_layer_ids(cfg.aux_layer_ids, format)  # validates the format too
    state = _cpu_contiguous(head.state_dict())
    check_state_dict(state, cfg, "head")
    dtype = dtype or state["fc.weight"].dtype
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    check_state_dict(tensors, cfg, "export")
    config = export_config(cfg, format, dtype)
    ours = {
        "format": FORMAT,
        "export_format": format,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "engine_layer_ids": layer_ids,
        "target_num_layers": cfg.target_num_layers,
        "version": int(getattr(head, "version", 0)),
    }

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / "tailspec_export.json").write_text(json.dumps(ours, indent=2, sort_keys=True))

    out = _write_dir_atomically(Path(out_dir), write)
    logger.info("exported EAGLE-3 head for %s to %s", format, out)
    return out


def read_exported(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = Path(path)
    return _read_json(path / "config.json"), _read_safetensors(path / "model.safetensors")


def head_from_export(path: str | Path, *, format: str) -> Eagle3Head:
    """Rebuild the head from an export (the inverse of :func:`export_checkpoint`)."""
    config, tensors = read_exported(path)
    if config.get("architectures") != [EXPORT_ARCHITECTURE]:
        raise ValueError(f"{path} is not an {EXPORT_ARCHITECTURE} export")
    extra = _read_json(Path(path) / "tailspec_export.json")
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    cfg = Eagle3Config(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config["target_hidden_size"],
        target_num_layers=extra["target_num_layers"],
        aux_layer_ids=_from_engine_layer_ids(ids, format),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
    )
    check_state_dict(tensors, cfg, str(path))
    head = Eagle3Head(cfg).to(tensors["fc.weight"].dtype)
    head.load_state_dict(tensors)
    return head
