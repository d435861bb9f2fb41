"""Stage ``attention``: the split-KV Triton decode attention against gather + SDPA.

One layer's attention of an 8B-shaped model (32 query heads, 8 KV heads of 128, bf16) over
contexts of 512 to 32k tokens at batch 1, 16 and 64, decode and a 5-token verification, every
variant of the kernel (keys per block x split count around the automatic one) interleaved with the
torch path over 3 passes, each timed replaying a CUDA graph of 10 calls (run 10 timed eager calls:
at batch 1 the host's launches, about 0.15 ms a call, hid the kernel's 10-100 us). Per shape: the
medians and their spread, the best variant, its relative error against a float64 reference, its
achieved bytes/s against the copy bandwidth, and the eager calls' time. Targets: at least 70% of
the copy bandwidth from 8k, never slower than gather + SDPA. Since run 10 (faster at every shape)
``kernels="auto"`` runs it for 16-bit decode and verification on CUDA.
"""

from __future__ import annotations

import torch

from ..kernels import measure_split_kv
from .common import Stage, device
from .env import copy_bandwidth_gbs
from .kernels import interpreter_works

FULL = [(b, c, 1) for c in (512, 2048, 8192, 32768) for b in (1, 16, 64)] + [(16, c, 5) for c in (2048, 32768)]
TINY = [(1, 200, 1), (2, 90, 5)]


def run(stage: Stage) -> None:
    dev = device()
    full = stage.size.name == "full"
    if not torch.cuda.is_available() and not interpreter_works():
        stage.skip("split-KV attention", "needs CUDA or a Triton whose interpreter runs these kernels (3.7+)")
        return
    heads, kv_heads, head_dim, dtype = (32, 8, 128, torch.bfloat16) if full else (4, 2, 16, torch.float32)
    copy = copy_bandwidth_gbs(1 << 30) if full else None
    rows = []
    for seqs, context, new in FULL if full else TINY:
        with stage.part(f"{seqs} x {context} ({new} new)", 4) as ok:
            if not ok:
                continue
            row = measure_split_kv(dev, seqs, context, new, heads, kv_heads, head_dim, dtype, 20 if full else 1)
            row["copy_share"] = round(row["best_gb_s"] / copy, 3) if copy else None
            rows.append(row)
            stage.record("split_kv", rows)
            limit = 2e-2 if dtype == torch.bfloat16 else 1e-3
            stage.check(
                f"split-KV {row['shape']}: relative error", row["rel_error"] <= limit, f"{row['rel_error']:.1e}"
            )
            stage.target(
                f"{row['shape']}: at least gather + SDPA", row["best_vs_gather"] >= 1.0, str(row["best_vs_gather"])
            )
            if full and context >= 8192 and new == 1:
                stage.target(
                    f"{row['shape']}: at least 70% of the copy bandwidth",
                    row["copy_share"] >= 0.7,
                    str(row["copy_share"]),
                )
    stage.record("copy_gbs", copy)
