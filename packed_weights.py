"""How shipped weights are stored: 16-bit safetensors, packed losslessly to keep the tree small.

A model directory in ``assets/`` holds ``model.safetensors.planes.xz`` beside its ``config.json``
instead of ``model.safetensors``: the safetensors file's bytes transposed into byte planes
(every ``stride``-th byte together, so the sign-and-exponent bytes of the 16-bit weights sit in
one run that compresses to a third while the mantissa bytes stay as they are) and xz-compressed.
The sidecar ``model.safetensors.planes.json`` records the stride, the size and the SHA-256 of the
original file. :func:`unpacked_dir` restores the exact original bytes once per machine, into a
cache directory keyed by that hash (``$TAILSPEC_CACHE``, else ``$XDG_CACHE_HOME/tailspec``, else
``~/.cache/tailspec``), and returns a directory ``from_pretrained`` loads. A directory that holds a
plain ``model.safetensors`` (a recipe's fresh output) is returned as it is.

``tailspec pack-assets`` stores floating-point tensors as float16 (weights trained in fp32 lose
what lies below fp16's 11-bit mantissa; see assets/*/MODEL_CARD.md) and packs every shipped model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .safe_files import check_safetensors_bytes

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
PACKED_FILE = WEIGHTS_FILE + ".planes.xz"
PACKED_META = WEIGHTS_FILE + ".planes.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def to_planes(data: bytes, stride: int) -> bytes:
    """Byte ``i`` of every ``stride``-byte word together, for ``i`` in ``0..stride-1`` (zero-padded)."""
    padded = data + b"\0" * (-len(data) % stride)
    return np.frombuffer(padded, dtype=np.uint8).reshape(-1, stride).T.tobytes()


def from_planes(planes: bytes, stride: int, size: int) -> bytes:
    """The inverse of :func:`to_planes`: the first ``size`` bytes of the interleaved words."""
    return np.frombuffer(planes, dtype=np.uint8).reshape(stride, -1).T.tobytes()[:size]


def cache_root() -> Path:
    if os.environ.get("TAILSPEC_CACHE"):
        return Path(os.environ["TAILSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tailspec"


def to_float16(path: Path) -> None:
    """Rewrite ``path`` (a safetensors file) with every floating-point tensor as float16; others kept."""
    tensors = load_file(path)
    for name, t in tensors.items():
        if t.is_floating_point() and t.dtype != torch.float16:
            big = float(t.abs().max()) if t.numel() else 0.0
            if big >= 65504:
                raise ValueError(f"{path}: tensor {name} has |value| {big} beyond float16's range")
            tensors[name] = t.to(torch.float16)
    save_file(tensors, path, metadata={"format": "pt"})


def pack(model_dir: str | Path, stride: int = 2) -> Path:
    """Replace ``model_dir/model.safetensors`` by its packed form (lossless); returns the packed file."""
    model_dir = Path(model_dir)
    source = model_dir / WEIGHTS_FILE
    data = source.read_bytes()
    packed = lzma.compress(to_planes(data, stride), preset=9)
    if from_planes(lzma.decompress(packed), stride, len(data)) != data:  # never ship what cannot be restored
        raise RuntimeError(f"packing {source} did not round-trip")
    (model_dir / PACKED_FILE).write_bytes(packed)
    meta = {"stride": stride, "size": len(data), "sha256": _sha256(data)}
    (model_dir / PACKED_META).write_text(json.dumps(meta, indent=2) + "\n")
    source.unlink()
    return model_dir / PACKED_FILE


def is_packed(model_dir: str | Path) -> bool:
    model_dir = Path(model_dir)
    return not (model_dir / WEIGHTS_FILE).exists() and (model_dir / PACKED_FILE).exists()


def _restored(model_dir: Path) -> tuple[dict, bytes]:
    """The packed weights' metadata and exact bytes; a ``ValueError`` naming the file and what to do
    when the pack is damaged, truncated, of the wrong size or hash, or its index is missing."""
    packed, index = model_dir / PACKED_FILE, model_dir / PACKED_META
    fix = "restore the folder from the checkout (git checkout -- <folder>) or from where you downloaded it"
    try:
        meta = json.loads(index.read_text())
        stride, size, digest = int(meta["stride"]), int(meta["size"]), str(meta["sha256"])
    except FileNotFoundError:
        raise ValueError(f"{index} is missing: {packed} cannot be unpacked without it; {fix}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{index} is not a valid plane index ({e}); {fix}") from None
    try:
        planes = lzma.decompress(packed.read_bytes())
    except (lzma.LZMAError, EOFError) as e:
        raise ValueError(f"{packed} is damaged or truncated ({e}); {fix}") from None
    if len(planes) != size + (-size % stride):  # to_planes pads the last word
        raise ValueError(f"{packed} holds {len(planes)} bytes where {index} says {size}; {fix}")
    data = from_planes(planes, stride, size)
    if _sha256(data) != digest:
        raise ValueError(f"{packed} is corrupted: its SHA-256 differs from {index}'s; {fix}")
    check_safetensors_bytes(data, packed)  # its hash is the pack's own word: what it unpacks to is checked
    return meta, data


def _copy_side_files(model_dir: Path, target: Path) -> None:
    """Every file of ``model_dir`` but the pack (config, tokenizer, ...) into ``target``, where it
    is missing or differs."""
    for item in model_dir.iterdir():
        if item.is_file() and item.name not in (PACKED_FILE, PACKED_META):
            copy = target / item.name
            if not copy.exists() or copy.read_bytes() != item.read_bytes():
                shutil.copyfile(item, copy)


def unpacked_dir(model_dir: str | Path) -> Path:
    """A directory with ``model_dir``'s files and its exact ``model.safetensors`` (see the module doc).
    A damaged pack is refused before anything is written to the cache."""
    model_dir = Path(model_dir)
    if (model_dir / WEIGHTS_FILE).exists():
        return model_dir
    if not (model_dir / PACKED_FILE).exists():
        raise FileNotFoundError(f"{model_dir} holds neither {WEIGHTS_FILE} nor {PACKED_FILE}")
    try:
        digest = json.loads((model_dir / PACKED_META).read_text())["sha256"]
        target = cache_root() / "weights" / f"{model_dir.name}-{digest[:16]}"
        if (target / WEIGHTS_FILE).exists():
            _copy_side_files(model_dir, target)  # a tokenizer added to the folder since it was unpacked
            return target
    except (OSError, ValueError, KeyError, TypeError):
        pass  # _restored says what is wrong
    meta, data = _restored(model_dir)
    target = cache_root() / "weights" / f"{model_dir.name}-{meta['sha256'][:16]}"
    target.mkdir(parents=True, exist_ok=True)
    _copy_side_files(model_dir, target)
    # written beside and renamed: concurrent loaders (Ray workers) never read half a file
    fd, tmp = tempfile.mkstemp(dir=target, suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, target / WEIGHTS_FILE)
    logger.info("unpacked %s into %s", model_dir, target)
    return target


def weights_location(path: str | Path) -> str | Path:
    """Where ``from_pretrained`` / ``load_checkpoint`` should read ``path``: its unpacked copy when it
    is a packed model directory, ``path`` itself otherwise (a plain directory, a hub id)."""
    return unpacked_dir(path) if is_packed(path) else path


def pack_shipped(assets_root: str | Path, *, float16: bool = True) -> list[Path]:
    """Pack every model directory (one holding ``model.safetensors``) under ``assets_root``."""
    done = []
    for source in sorted(Path(assets_root).glob(f"*/*/{WEIGHTS_FILE}")):
        if float16:
            to_float16(source)
            config = source.parent / "config.json"
            cfg = json.loads(config.read_text())
            if "dtype" in cfg:  # HF configs record the stored dtype; EAGLE-3 configs do not
                cfg["dtype"] = "float16"
                config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        done.append(pack(source.parent))
    return done
