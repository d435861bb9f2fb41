"""Reading files from a path a user gives, without ever running code from them.

Checkpoints travel (downloaded folders, shared storage, other people's runs), and a pickle runs
whatever its author put in it. So tailspec reads what it is handed only as data:

* tensors from safetensors (:func:`read_safetensors`; raw bytes checked by :func:`check_safetensors_bytes`);
* everything else that is not a tensor as JSON (:func:`read_json`); an optimizer's
  ``state_dict()`` is split by :func:`split_optimizer_state` into a JSON tree and its tensors, and
  joined back by :func:`join_optimizer_state` with its exact types;
* a ``.pt`` file only through torch's weights-only unpickler, with the few plain classes the caller
  names allowed (:func:`load_weights_only`): checkpoints written before a format moved to
  safetensors, and DeepSpeed's own files;
* Hugging Face models from safetensors only, never with the model's own code
  (:func:`load_causal_lm`).

Anything else is refused with :class:`UnsafeFile`, one line naming the file and why, before a
byte of it is used. docs/ARCHITECTURE.md, "What is loaded from where", lists every loader.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

# the largest safetensors header the format allows (its reference reader's limit)
_MAX_HEADER_BYTES = 100_000_000


class UnsafeFile(ValueError):
    """A file refused because reading it could run code, or because it is not what it claims."""

    def __init__(self, path: str | Path, why: str) -> None:
        super().__init__(f"{path}: refused: {why}")
        self.path = str(path)


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing, unreadable or non-object file is a ``ValueError``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def check_safetensors_bytes(data: bytes, source: str | Path) -> None:
    """Refuse ``data`` unless it starts as a safetensors file does: an 8-byte little-endian header
    length, then that many bytes of a JSON object (a pickle or anything else fails here)."""
    if len(data) < 8:
        raise UnsafeFile(source, "not a safetensors file (shorter than its 8-byte header length)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise UnsafeFile(source, f"not a safetensors file (a header of {size} bytes in {len(data)})")
    try:
        header = json.loads(data[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UnsafeFile(source, "not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UnsafeFile(source, "not a safetensors file (its header is not a JSON object)")


def read_safetensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing, damaged or foreign file is a ``ValueError``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} is corrupted or not a safetensors file: {e}") from e


def load_weights_only(
    path: str | Path, *, allow: Iterable[type] = (), map_location: str | torch.device | None = "cpu"
) -> Any:
    """``torch.load`` of ``path`` through torch's weights-only unpickler: tensors, containers and
    numbers, plus the classes in ``allow`` (plain data classes the caller names). A file holding any
    other object is refused before that object is built, so its payload never runs."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _unsafe_globals(path)
        what = f"it asks for {', '.join(found)}" if found else str(e).splitlines()[0]
        raise UnsafeFile(path, f"holds objects a weights-only load does not build ({what})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise UnsafeFile(path, f"not a readable torch file ({str(e).splitlines()[0]})") from None


def _unsafe_globals(path: str | Path) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # a legacy (non-zip) file, or one too broken to list
        return []


# -- optimizer state as JSON plus tensors -------------------------------------------------------
# A torch optimizer's state_dict() is {"state": {param_index: {name: value}}, "param_groups": [...]}.
# JSON keeps all but tensors: n-d tensors go to a safetensors file under their dotted path
# (``state.{index}.{name}``) and are referred to as {"__tensor__": key}; 0-d tensors (AdamW's
# ``step``) stay as {"__scalar__": number, "dtype": name}; tuples (``betas``) as {"__tuple__":
# [...]}. Joining restores the exact types, so the state dict round-trips.
def split_optimizer_state(
    state: dict[str, Any], name: str = "optimizer_state"
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An optimizer's ``state_dict()`` (``name``: what the caller calls it, for errors) as a
    JSON-able tree and the tensors it refers to."""
    if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
        raise ValueError(f"{name} must be a torch optimizer state_dict() (with 'state' and 'param_groups')")
    tensors: dict[str, torch.Tensor] = {}
    tree = {
        "state": {str(i): _encode(entry, f"state.{i}", tensors) for i, entry in state["state"].items()},
        "param_groups": [_encode(g, f"param_groups.{i}", tensors) for i, g in enumerate(state["param_groups"])],
    }
    return tree, tensors


def join_optimizer_state(tree: Any, tensors: dict[str, torch.Tensor], source: str | Path) -> dict[str, Any]:
    """The inverse of :func:`split_optimizer_state`. Every stored tensor must be referred to exactly
    once: a reference to a missing tensor, or a tensor nothing names, is a ``ValueError``."""
    if not isinstance(tree, dict) or not isinstance(tree.get("state"), dict):
        raise ValueError(f"{source}: the optimizer state must hold 'state' and 'param_groups'")
    used: set[str] = set()
    try:
        state = {int(i): _decode(entry, tensors, used) for i, entry in tree["state"].items()}
        groups = _decode(tree["param_groups"], tensors, used)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}: malformed optimizer state: {e}") from e
    if set(tensors) - used:
        raise ValueError(f"{source}: holds optimizer tensors its JSON does not name: {sorted(set(tensors) - used)}")
    return {"state": state, "param_groups": groups}


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return {"__scalar__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
        tensors[key] = value.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _encode(v, f"{key}.{k}", tensors) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"optimizer state entry {key} holds a {type(value).__name__}, which a checkpoint cannot store")


def _decode(value: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, used) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        key = value["__tensor__"]
        if key not in tensors:
            raise ValueError(f"the tensor {key!r} it refers to is not stored")
        used.add(key)
        return tensors[key]
    if "__scalar__" in value:
        dtype = getattr(torch, str(value.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a scalar of unknown dtype {value.get('dtype')!r}")
        return torch.tensor(value["__scalar__"], dtype=dtype)
    if "__tuple__" in value:
        return tuple(_decode(v, tensors, used) for v in value["__tuple__"])
    return {k: _decode(v, tensors, used) for k, v in value.items()}


# -- Hugging Face models ------------------------------------------------------------------------
def load_causal_lm(location: str | Path, **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` from safetensors only, with transformers' own
    model code (``trust_remote_code`` off): a folder holding only ``pytorch_model.bin`` (a pickle)
    is refused in one line naming it."""
    from transformers import AutoModelForCausalLM

    if kwargs.get("trust_remote_code"):
        raise ValueError(f"{location}: tailspec never runs a model's own code (trust_remote_code=True)")
    folder = Path(location)
    if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.safetensors.index.json")):
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        why = f"holds {', '.join(pickled)} (pickles) and no safetensors weights" if pickled else "holds no safetensors"
        raise UnsafeFile(folder, f"{why}; tailspec loads weights from safetensors only (save_pretrained writes them)")
    return AutoModelForCausalLM.from_pretrained(location, use_safetensors=True, trust_remote_code=False, **kwargs)
