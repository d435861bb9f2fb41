"""DeepSpeed for the GRPO trainer: the shipped ZeRO configs and a single-process launch.

``GRPOConfig(deepspeed=deepspeed_config("zero3"))`` trains under ZeRO-3; the rollout generates
with the full parameters gathered for the call, exactly as TRL's own generation does
(``SpecRollout`` enters ``trl.models.unwrap_model_for_generation`` with
``ds3_gather_for_generation``). Under ``accelerate launch``/``deepspeed`` the launcher sets the
distributed environment; a plain ``python`` run gets a one-process group from
:func:`single_process_deepspeed`.
"""

from __future__ import annotations

from pathlib import Path

from ..configs import configs_dir
from ..distributed import single_process_deepspeed
from ..extras import need

SHIPPED = {"zero2": "deepspeed_zero2.json", "zero3": "deepspeed_zero3.json"}


def deepspeed_config(spec: str) -> str:
    """Path of a DeepSpeed JSON: ``"zero2"``/``"zero3"`` (shipped in configs/) or a file path."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"deepspeed must be 'zero2', 'zero3' or a path to a DeepSpeed JSON, got {spec!r}")
    if spec in SHIPPED:
        return str(configs_dir() / SHIPPED[spec])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"deepspeed must be 'zero2', 'zero3' or a path to a DeepSpeed JSON; no file at {spec!r}")
    return str(path)


def require_deepspeed() -> None:
    need("deepspeed", "deepspeed", "a DeepSpeed config")


def deepspeed_training_args(spec: str | None) -> dict[str, str]:
    """``GRPOConfig`` keyword arguments for ``spec`` (none when it is None): checks DeepSpeed is
    installed and gives a launcher-less run its one-process group first."""
    if spec is None:
        return {}
    path = deepspeed_config(spec)
    require_deepspeed()
    single_process_deepspeed()
    return {"deepspeed": path}


def gathered(*modules):
    """A context in which ``modules``' parameters are whole: under ZeRO-3 (parameters carrying
    DeepSpeed's ``ds_id``) they are gathered for reading; otherwise nothing happens."""
    import contextlib

    params = [p for m in modules for p in m.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
