"""A rollout's learned state on disk, beside the trainer's checkpoint, so a resumed run continues
warm: the drafter (EAGLE-3 head weights as safetensors, its optimizer state, step and version),
each engine's adaptive-selector measurements and suffix-drafter history, and the length
predictor's per-prompt history (JSON).

Layout of ``<checkpoint>/tailspec_rollout/``: ``state.json``, ``drafter.safetensors`` and
``drafter_optimizer.pt`` (the last two only with an EAGLE-3 head; the optimizer only once trained).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..workers.worker import DrafterState

FOLDER = "tailspec_rollout"


def save_rollout_state(state: dict[str, Any], checkpoint_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    folder = Path(checkpoint_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    drafter: DrafterState | None = state.get("drafter")
    meta = {"engines": state.get("engines") or [], "predictor": state.get("predictor"), "drafter": None}
    if drafter is not None:
        save_file({k: v.contiguous() for k, v in drafter.head.items()}, str(folder / "drafter.safetensors"))
        meta["drafter"] = {"version": drafter.version, "step": drafter.step}
        if drafter.optimizer is not None:
            torch.save(drafter.optimizer, folder / "drafter_optimizer.pt")
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
    drafter = None
    if meta.get("drafter") is not None:
        optimizer_path = folder / "drafter_optimizer.pt"
        drafter = DrafterState(
            head=load_file(str(folder / "drafter.safetensors")),
            version=int(meta["drafter"]["version"]),
            step=int(meta["drafter"]["step"]),
            optimizer=torch.load(optimizer_path, weights_only=False) if optimizer_path.exists() else None,
        )
    return {"engines": meta.get("engines") or [], "predictor": meta.get("predictor"), "drafter": drafter}
