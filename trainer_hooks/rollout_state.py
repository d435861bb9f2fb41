"""A rollout's learned state on disk, beside the trainer's checkpoint, so a resumed run continues
warm: the drafter (weights and optimizer tensors as safetensors, the optimizer's other values,
step and version as JSON), each engine's adaptive-selector measurements and suffix-drafter
history, and the length predictor's per-prompt history (JSON).

Layout of ``<checkpoint>/tailspec_rollout/``: ``state.json``, ``drafter.safetensors`` and
``drafter_optimizer.safetensors`` (the last two only with a trained part: an EAGLE-3 head, a
drafter LM or its streaming heads, an exit adapter; the optimizer only once trained), and
``drafter_trained.*`` likewise for spot training's trained state while it has not shipped.

Nothing here is unpickled: a resumed run reads a checkpoint folder that may come from anywhere.
A ``drafter_optimizer.pt`` that an earlier tailspec wrote is read through torch's weights-only
unpickler; one holding anything but tensors and plain values is refused (:mod:`tailspec.safe_files`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..drafter.online_training import DrafterState
from ..safe_files import (
    join_optimizer_state,
    load_weights_only,
    read_json,
    read_safetensors,
    split_optimizer_state,
)

FOLDER = "tailspec_rollout"


# drafter states kept apart: the drafting (shipped) one, and spot training's newest trained one
# when it has not shipped (training continues from it after a resume)
DRAFTER_KEYS = ("drafter", "drafter_trained")
JSON_KEYS = ("engines", "predictor", "catch_up")


def save_rollout_state(state: dict[str, Any], checkpoint_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    folder = Path(checkpoint_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {key: state.get(key) for key in JSON_KEYS}
    meta["engines"] = meta["engines"] or []
    for key in DRAFTER_KEYS:
        drafter: DrafterState | None = state.get(key)
        meta[key] = None
        if drafter is None:
            continue
        save_file({k: v.contiguous() for k, v in drafter.weights.items()}, str(folder / f"{key}.safetensors"))
        meta[key] = {"version": drafter.version, "step": drafter.step, "optimizer": None}
        if drafter.optimizer is not None:
            meta[key]["optimizer"], tensors = split_optimizer_state(drafter.optimizer)
            save_file(tensors, str(folder / f"{key}_optimizer.safetensors"))
    (folder / "state.json").write_text(json.dumps(meta))
    return folder


def load_rollout_state(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The state saved in ``checkpoint_dir`` (None when it holds none, e.g. a checkpoint written
    before this existed). A file that is not what it should be is a ``ValueError`` naming it."""
    folder = Path(checkpoint_dir) / FOLDER
    if not (folder / "state.json").exists():
        return None
    meta = read_json(folder / "state.json")
    state: dict[str, Any] = {key: meta.get(key) for key in JSON_KEYS}
    state["engines"] = state["engines"] or []
    for key in DRAFTER_KEYS:
        saved = meta.get(key)
        if saved is None:
            state[key] = None
            continue
        if not isinstance(saved, dict) or not {"version", "step"} <= set(saved):
            raise ValueError(f"{folder / 'state.json'}: {key!r} must hold 'version' and 'step'")
        state[key] = DrafterState(
            weights=read_safetensors(folder / f"{key}.safetensors"),
            version=int(saved["version"]),
            step=int(saved["step"]),
            optimizer=_optimizer(folder, key, saved.get("optimizer")),
        )
    return state


def _optimizer(folder: Path, key: str, tree: Any) -> dict[str, Any] | None:
    """The optimizer state saved for ``key``: JSON plus safetensors, or an earlier tailspec's
    ``.pt`` read weights-only; None when neither was saved."""
    tensors_path, legacy_path = folder / f"{key}_optimizer.safetensors", folder / f"{key}_optimizer.pt"
    if tree is not None:
        return join_optimizer_state(tree, read_safetensors(tensors_path), tensors_path)
    if legacy_path.exists():
        state = load_weights_only(legacy_path)
        if not isinstance(state, dict) or not {"state", "param_groups"} <= set(state):
            raise ValueError(f"{legacy_path} is not an optimizer state_dict (no 'state' and 'param_groups')")
        return state
    return None
