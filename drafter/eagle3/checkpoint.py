"""EAGLE-3 checkpoints (tailspec's own, with optimizer state) and export to SGLang / vLLM.

A tailspec checkpoint is a directory: ``config.json`` (format, checkpoint version, the
:class:`Eagle3Config`, training step, weights version, metadata, the optimizer's non-tensor
state), ``model.safetensors`` (the head's state dict) and, when saved with one,
``optimizer.safetensors`` (the optimizer's tensors as ``state.{param}.{name}``).

An export is the ``LlamaForCausalLMEagle3`` layout both engines load: a flat Llama
``config.json`` with ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config`` and a
``model.safetensors`` of ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (no
``embed_tokens``: both engines share the target's). The tapped-layer ids differ by one between
the two engines (see :func:`engine_layer_ids`).

Every write goes to a temporary directory next to the destination, is fsynced and renamed into
place, so a crash never leaves half a checkpoint; every read checks keys, shapes and dtypes
against :func:`expected_shapes`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ...packed_weights import weights_location
from ...safe_files import join_optimizer_state, read_json, read_safetensors, split_optimizer_state
from .model import Eagle3Config, Eagle3Head, default_aux_layer_ids

logger = logging.getLogger(__name__)

FORMAT = "tailspec-eagle3"
CHECKPOINT_VERSION = 1
EXPORT_FORMATS = ("sglang", "vllm")
EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
EXPORT_META_FILE = "tailspec_export.json"


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


def check_state_dict(
    tensors: dict[str, torch.Tensor], cfg: Eagle3Config, source: str, *, for_export: bool = False
) -> None:
    """Refuse missing, unexpected or mis-shaped keys, wrong dtypes, non-finite weights and a ``d2t``
    that leaves the target vocabulary. ``for_export`` also requires the vocabulary map to be a real
    one (distinct target ids, ``t2d`` marking exactly them), since the engines serve it as is."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(f"{source}: missing keys {missing}, unexpected keys {unexpected}")
    for key, shape in want.items():
        t = tensors[key]
        got = tuple(t.shape)
        if got != shape:
            raise ValueError(f"{source}: {key} has shape {list(got)}, expected {list(shape)}")
        if key == "t2d":
            if t.dtype != torch.bool:
                raise ValueError(f"{source}: t2d must be bool, got {t.dtype}")
        elif key == "d2t":
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"{source}: d2t must be an integer tensor, got {t.dtype}")
        elif not t.is_floating_point():
            raise ValueError(f"{source}: {key} must be a floating-point tensor, got {t.dtype}")
        elif not bool(torch.isfinite(t).all()):
            raise ValueError(f"{source}: {key} holds NaN or inf values")
    targets = torch.arange(cfg.draft_vocab_size) + tensors["d2t"].detach().to("cpu", torch.long)
    if targets.min() < 0 or targets.max() >= cfg.vocab_size:
        raise ValueError(f"{source}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    if for_export:
        mask = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        mask[targets] = True
        if int(mask.sum()) != cfg.draft_vocab_size:
            raise ValueError(f"{source}: d2t maps several draft ids to the same target id (vocabulary map not set?)")
        if not torch.equal(mask, tensors["t2d"].detach().cpu()):
            raise ValueError(f"{source}: t2d does not mark exactly the target ids d2t maps to")


# -- files -------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. directories on platforms that cannot open them
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_replaceable(path: Path) -> bool:
    """Only an empty directory or one this module wrote may be replaced by a new write."""
    if not any(path.iterdir()) or (path / EXPORT_META_FILE).is_file():
        return True
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _write_dir_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write`` into a fresh temporary directory next to ``path``, fsync it, then rename it into
    place. A previous directory at ``path`` is moved aside first and deleted last (put back if the
    final rename fails), so a crash never leaves a mix of old and new files; in the instant between
    the two renames the previous checkpoint sits complete at ``.{name}.old-*``."""
    path = Path(path)
    if path.exists() and not (path.is_dir() and _is_replaceable(path)):
        raise ValueError(f"{path} exists and is not an EAGLE-3 checkpoint or export; refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    old: Path | None = None
    try:
        write(tmp)
        for child in tmp.iterdir():
            _fsync(child)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        _fsync(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old)  # a directory may replace an empty one
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            os.replace(old, path)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _cpu_contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# -- tailspec checkpoints ----------------------------------------------------------------
def save_checkpoint(
    path: str | Path,
    head: Eagle3Head,
    *,
    step: int = 0,
    version: int = 0,
    optimizer_state: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write a tailspec checkpoint directory (atomically; an existing checkpoint at ``path`` is
    replaced only once the new one is complete)."""
    state = _cpu_contiguous(head.state_dict())
    check_state_dict(state, head.config, "head")
    config: dict[str, Any] = {
        "format": FORMAT,
        "checkpoint_version": CHECKPOINT_VERSION,
        "eagle3_config": head.config.to_dict(),
        "step": int(step),
        "version": int(version),
        "metadata": dict(metadata or {}),
    }
    opt_tensors: dict[str, torch.Tensor] = {}
    if optimizer_state is not None:
        config["optimizer"], opt_tensors = split_optimizer_state(optimizer_state)
    try:
        json.dumps(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint metadata / config must be JSON-serializable: {e}") from e

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        if optimizer_state is not None:
            save_file(_cpu_contiguous(opt_tensors), str(tmp / OPTIMIZER_FILE), metadata={"format": "pt"})
        _write_json(tmp / CONFIG_FILE, config)

    out = _write_dir_atomically(Path(path), write)
    logger.info("saved EAGLE-3 checkpoint (step %d, version %d) to %s", step, version, out)
    return out


def _head_from_tensors(cfg: Eagle3Config, tensors: dict[str, torch.Tensor]) -> Eagle3Head:
    """A head holding exactly ``tensors`` (their dtypes and device kept: ``assign=True``). Built on the
    meta device, so loading neither spends time on a random init nor advances the global RNG."""
    with torch.device("meta"):
        head = Eagle3Head(cfg)
    head.load_state_dict(tensors, strict=True, assign=True)
    return head


def load_checkpoint(
    path: str | Path, *, target_config: Any | None = None, map_location: str | torch.device = "cpu"
) -> Eagle3Checkpoint:
    """Read a tailspec checkpoint, refusing anything incomplete, corrupted, too new or made for
    another target (``target_config``: the target's HF config)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"EAGLE-3 checkpoint directory {path} does not exist")
    path = Path(weights_location(path))  # a shipped head (assets/*/eagle3) is packed
    config_path = path / CONFIG_FILE
    config = read_json(config_path)
    if config.get("format") != FORMAT:
        raise ValueError(f"{config_path} is not a tailspec EAGLE-3 checkpoint (format {config.get('format')!r})")
    version = config.get("checkpoint_version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= CHECKPOINT_VERSION:
        raise ValueError(
            f"{path} has checkpoint_version {version!r}; this tailspec reads versions 1 to {CHECKPOINT_VERSION}"
        )
    try:
        cfg = Eagle3Config.from_dict(dict(config["eagle3_config"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: missing or malformed 'eagle3_config': {e!r}") from e
    if target_config is not None:
        cfg.check_target(target_config)
    tensors = read_safetensors(path / MODEL_FILE, map_location)
    check_state_dict(tensors, cfg, str(path / MODEL_FILE))
    head = _head_from_tensors(cfg, tensors)
    optimizer_state = None
    if config.get("optimizer") is not None:
        opt_tensors = read_safetensors(path / OPTIMIZER_FILE, map_location)
        optimizer_state = join_optimizer_state(config["optimizer"], opt_tensors, path / OPTIMIZER_FILE)
    step, weights_version, metadata = config.get("step", 0), config.get("version", 0), config.get("metadata", {})
    if not isinstance(step, int) or not isinstance(weights_version, int) or not isinstance(metadata, dict):
        raise ValueError(f"{config_path}: 'step' and 'version' must be integers and 'metadata' an object")
    head.version = weights_version
    return Eagle3Checkpoint(head, step, weights_version, optimizer_state, metadata)


# -- SGLang / vLLM export ----------------------------------------------------------------
def engine_layer_ids(aux_layer_ids: tuple[int, ...], fmt: str) -> list[int]:
    """Our ids name the target layer whose *input* is tapped (0 = the embeddings).

    * vLLM (``model_executor/models/llama.py`` ``LlamaModel.forward``: ``if idx in
      self.aux_hidden_state_layers: aux.append(hidden_states + residual)`` before running layer
      ``idx``) uses configured ids with the same meaning, so they are written unchanged.
    * SGLang (``srt/models/llama.py`` ``set_eagle3_layers_to_capture``: ``[val + 1 for val in
      layer_ids]``, then the same capture-before-layer loop) adds one, so it is given ``id - 1``
      and cannot tap the embeddings (id 0 would be configured as -1).
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if fmt == "vllm":
        if 0 in aux_layer_ids:
            logger.warning(
                "aux layer id 0 (the embeddings): vLLM's Llama/Qwen targets capture hidden_states + residual "
                "and have no residual before layer 0, so this export may fail there"
            )
        return list(aux_layer_ids)
    if 0 in aux_layer_ids:
        raise ValueError(
            "SGLang cannot tap the embeddings (aux layer id 0): it adds 1 to configured ids; "
            "choose aux layer ids >= 1 for an SGLang export"
        )
    return [i - 1 for i in aux_layer_ids]


def _from_engine_layer_ids(ids: list[int], fmt: str) -> tuple[int, ...]:
    return tuple(int(i) + 1 for i in ids) if fmt == "sglang" else tuple(int(i) for i in ids)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_config(cfg: Eagle3Config, fmt: str, dtype: torch.dtype) -> dict[str, Any]:
    """The flat Llama ``config.json`` of an export (what both engines' ``LlamaForCausalLMEagle3`` read)."""
    layer_ids = engine_layer_ids(cfg.aux_layer_ids, fmt)
    config: dict[str, Any] = {
        "architectures": [EXPORT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers < 5 (what the engines pin) read rope_theta; transformers 5 reads rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
        # SGLang reads only the nested ids (model_runner: eagle_config["eagle_aux_hidden_state_layer_ids"])
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }
    if fmt == "vllm":
        # current vLLM (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config)
        # reads the top-level key; older releases fell back to eagle_config
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    return config


def export_checkpoint(
    head: Eagle3Head, out_dir: str | Path, *, format: str, dtype: torch.dtype | str | None = None
) -> Path:
    """Write the ``LlamaForCausalLMEagle3`` layout for ``format`` ("sglang" or "vllm"), weights cast
    to ``dtype`` (default: the head's). Refuses an incomplete, mis-shaped or non-finite head and a
    vocabulary map the target cannot serve; writes atomically."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {format!r}")
    cfg = head.config
    state = _cpu_contiguous(head.state_dict())
    check_state_dict(state, cfg, "head", for_export=True)
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else (dtype or state["fc.weight"].dtype)
    if not (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        raise ValueError(f"dtype must be a torch floating-point dtype (e.g. torch.bfloat16), got {dtype!r}")
    dtype = resolved
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    check_state_dict(tensors, cfg, f"export ({_dtype_name(dtype)})", for_export=True)  # casting may overflow
    config = export_config(cfg, format, dtype)
    ours = {
        "format": FORMAT,
        "export_format": format,
        "aux_layer_ids": list(cfg.aux_layer_ids),
        "engine_layer_ids": config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "target_num_layers": cfg.target_num_layers,
        "extra": cfg.extra,
        "version": int(getattr(head, "version", 0)),
    }

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / EXPORT_META_FILE, ours)

    out = _write_dir_atomically(Path(out_dir), write)
    logger.info("exported EAGLE-3 head for %s (layer ids %s) to %s", format, ours["engine_layer_ids"], out)
    return out


def read_exported(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of an exported directory."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"exported EAGLE-3 directory {path} does not exist")
    return read_json(path / CONFIG_FILE), read_safetensors(path / MODEL_FILE)


def head_from_export(path: str | Path, *, format: str, target_num_layers: int | None = None) -> Eagle3Head:
    """Rebuild the head from an export (the inverse of :func:`export_checkpoint`, undoing SGLang's
    ``-1``). ``target_num_layers`` is needed only for exports without ``tailspec_export.json``."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {format!r}")
    path = Path(path)
    config, tensors = read_exported(path)
    if config.get("architectures") != [EXPORT_ARCHITECTURE]:
        raise ValueError(f"{path} is not an {EXPORT_ARCHITECTURE} export (architectures {config.get('architectures')})")
    ours = read_json(path / EXPORT_META_FILE) if (path / EXPORT_META_FILE).is_file() else {}
    if ours.get("export_format", format) != format:
        raise ValueError(
            f"{path} was exported for {ours['export_format']}, not {format}; layer ids would be off by one"
        )
    layers = target_num_layers or ours.get("target_num_layers")
    if layers is None:
        raise ValueError(f"{path} has no {EXPORT_META_FILE}; pass target_num_layers")
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")  # SGLang reads only these
    if format == "vllm":
        ids = config.get("eagle_aux_hidden_state_layer_ids") or ids  # vLLM prefers the top-level key
    rope = config.get("rope_parameters") or {}
    try:
        cfg = Eagle3Config(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            target_num_layers=int(layers),
            # no ids: both engines tap their default, the inputs to layers (2, L // 2, L - 3)
            aux_layer_ids=_from_engine_layer_ids(ids, format) if ids else default_aux_layer_ids(int(layers)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            hidden_act=config.get("hidden_act", "silu"),
            extra=dict(ours.get("extra") or {}),
        )
    except KeyError as e:
        raise ValueError(f"{path / CONFIG_FILE} lacks the field {e}") from e
    check_state_dict(tensors, cfg, str(path / MODEL_FILE))
    head = _head_from_tensors(cfg, tensors)
    head.version = int(ours.get("version", 0))
    return head
