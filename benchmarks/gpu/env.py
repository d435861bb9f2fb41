"""Stage ``env``: what the machine is, its two ceilings, and the engine without the trainer stack."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys

import torch

from .common import Stage, device, median, timed

TRAINER_STACK = ("trl", "ray", "deepspeed", "wandb")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def copy_bandwidth_gbs(nbytes: int, repeats: int = 10) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (METHOD.md)."""
    dev = device()
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timed(lambda: dst.copy_(src))[1] for _ in range(repeats)]
    return 2 * nbytes / median(times) / 1e9


def matmul_tflops(n: int, dtype: torch.dtype, repeats: int = 10) -> float:
    dev = device()
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    times = [timed(lambda: a @ b)[1] for _ in range(repeats)]
    return 2 * n**3 / median(times) / 1e12


def run(stage: Stage) -> None:
    versions = {p: _version(p) for p in ("torch", "transformers", "triton", "tokenizers", "safetensors", "numpy")}
    versions["python"] = platform.python_version()
    stage.record("versions", versions)
    stage.record("trainer_stack_installed", {p: _version(p) for p in TRAINER_STACK})
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        stage.record(
            "device",
            {
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}",
                "torch_cuda": torch.version.cuda,
            },
        )
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        stage.record("nvidia_smi", smi.stdout[-3000:])
    # the ceilings first: a fresh machine's imports in the probe below took most of the budget (run 9)
    big = 1 << 30 if torch.cuda.is_available() else 1 << 26
    with stage.part("copy bandwidth", 10) as ok:
        if ok:
            stage.record("copy_gbs", round(copy_bandwidth_gbs(big), 1))
    with stage.part("bf16 matrix rate", 10) as ok:
        if ok:
            n = 8192 if torch.cuda.is_available() else 512
            dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
            stage.record("matmul_tflops", round(matmul_tflops(n, dtype), 1))
    with stage.part("engine imports without trl, ray, deepspeed, wandb", 5) as ok:
        if ok:
            probe = (
                "import sys; import tailspec.rollout.engine, tailspec.drafter.small_lm, tailspec.kernels.dispatch;"
                f"print(sorted(m for m in {TRAINER_STACK!r} if m in sys.modules))"
            )
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
            loaded = out.stdout.strip()
            stage.check(
                "engine path loads none of the trainer stack",
                out.returncode == 0 and loaded == "[]",
                loaded or out.stderr[-500:],
            )
