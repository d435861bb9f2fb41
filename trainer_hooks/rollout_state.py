"""A rollout's learned state on disk, beside the trainer's checkpoint, so a resumed run continues
warm: the drafter (EAGLE-3 head weights as safetensors, its optimizer state, step and version),
each engine's adaptive-selector measurements and suffix-drafter history, and the length
predictor's per-prompt history (JSON).

Layout of ``<checkpoint>/tailspec_rollout/``: ``state.json``, ``drafter.safetensors`` and
``drafter_optimizer.pt`` (the last two only with a trained part: an EAGLE-3 head, a drafter LM or
its streaming heads, an exit adapter; the optimizer only once trained),
and ``drafter_trained.*`` likewise for spot training's trained state while it has not shipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..drafter.online_training import DrafterState

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
        meta[key] = {"version": drafter.version, "step": drafter.step}
        if drafter.optimizer is not None:
            torch.save(drafter.optimizer, folder / f"{key}_optimizer.pt")
    (folder / "state.json").write_text(json.dumps(meta))
    return folder


def load_rollout_state(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The state saved in ``checkpoint_dir`` (None when it holds none, e.g. a checkpoint written
    before this existed)."""
    from safetensors.torch import load_file

    folder = Path(checkpoint_dir) / FOLDER
    if not (folder / "state.json").exists():
        return None
    meta = json.loads((folder / "state.json").read_text())
    state: dict[str, Any] = {key: meta.get(key) for key in JSON_KEYS}
    state["engines"] = state["engines"] or []
    for key in DRAFTER_KEYS:
        saved = meta.get(key)
        if saved is None:
            state[key] = None
            continue
        optimizer_path = folder / f"{key}_optimizer.pt"
        state[key] = DrafterState(
            weights=load_file(str(folder / f"{key}.safetensors")),
            version=int(saved["version"]),
            step=int(saved["step"]),
            optimizer=torch.load(optimizer_path, weights_only=False) if optimizer_path.exists() else None,
        )
    return state
