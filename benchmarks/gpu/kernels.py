"""Stage ``kernels``: the Triton kernels compiled for the chip, against their torch references, timed.

Attention is checked by relative error against a float64 reference on the same (rounded) inputs
(METHOD.md: fp32 far under 1e-3, tf32 near 3e-4, bf16 operands 1e-3 to 1e-2); sampled verification
must reach exactly the torch rule's verdicts.
"""

from __future__ import annotations

from dataclasses import asdict
from importlib.metadata import version

import torch

from ..kernels import run_kernel_bench
from .common import Stage, device

REL_LIMIT = {"float32": 1e-3, "bfloat16": 2e-2}


def interpreter_works() -> bool:
    """Triton's CPU interpreter before 3.7 turns scalar kernel arguments into 1-element arrays that
    numpy 2 refuses as loop bounds: the image's Triton 3.6 cannot interpret these kernels (compiled
    on a GPU, that path is never taken; the test suite interprets them under its own Triton)."""
    major, minor = (int(x) for x in version("triton").split(".")[:2])
    return (major, minor) >= (3, 7)


def run(stage: Stage) -> None:
    dev = device()
    stage.record("compiled", torch.cuda.is_available())  # on CPU: Triton's interpreter, timings meaningless
    if not torch.cuda.is_available() and not interpreter_works():
        stage.skip("Triton kernels", f"needs CUDA: Triton {version('triton')}'s interpreter cannot run them here")
        return
    timings, _ = run_kernel_bench(dev, None, [], [], quick=stage.size.kernel_quick)
    stage.record("timings", [asdict(t) | {"speedup": round(t.speedup, 3)} for t in timings])
    for t in timings:
        if t.kernel.startswith("verify"):
            stage.check(f"verify {t.shape}", t.max_abs_diff == 0, f"{int(t.max_abs_diff)} mismatching verdicts")
        else:
            dtype = "bfloat16" if "bfloat16" in t.shape else "float32"
            stage.check(
                f"attention {t.shape}",
                t.rel_error <= REL_LIMIT[dtype],
                f"relative error {t.rel_error:.2e} (limit {REL_LIMIT[dtype]:.0e}), "
                f"torch {t.torch_ms:.3f} ms, triton {t.triton_ms:.3f} ms",
            )
