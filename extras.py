"""The optional parts of tailspec and the one line that says how to install each.

The library itself needs torch and transformers. What only one part needs is an extra
(``pip install "tailspec[trl]"``): ``trl`` for ``tailspec.GRPOTrainer`` and the demo, ``ray`` for
rollout workers, Ray draft hosts and ATTS on Ray, ``wandb`` for the demo's logging, ``deepspeed``
for DeepSpeed drafter training and GRPO runs, ``verl`` for the verl rollout backend. A part
imports what it needs through :func:`need`, so a missing extra is one line naming it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# each extra and the distributions it installs (pyproject.toml's optional dependencies)
EXTRAS = {
    "trl": ("trl", "datasets", "accelerate"),
    "ray": ("ray",),
    "wandb": ("wandb",),
    "deepspeed": ("deepspeed",),
    "verl": ("verl", "ray"),
}


class MissingExtra(ImportError):
    """A part of tailspec was used whose extra is not installed."""


def need(module: str, extra: str, what: str) -> ModuleType:
    """``module`` imported, or :class:`MissingExtra` saying that ``what`` needs ``extra``. An
    ImportError from inside an installed ``module`` (a broken install) is raised as it is."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {sorted(EXTRAS)}, got {extra!r}")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise
        raise MissingExtra(
            f"{what} needs {module.split('.')[0]}, which is not installed: pip install 'tailspec[{extra}]'"
        ) from None
