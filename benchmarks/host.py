"""Host work before each captured replay: the padded forward's inputs.

Before every replay of a captured forward, the target's at each decode or verification step and
the drafter LM's at each draft level, the runner builds the bucket's inputs on the host: token ids,
positions, the slots the new K/V go to, and either each sequence's gathered context slots and mask
(gather + SDPA) or its block table (the split-KV kernel). On a GPU that time adds to every step:
an H200 decoded at 5.3 ms a step at batch 16 and 22.4 ms at 256 when this was built with tensor
operations per sequence (docs/GPU.md, run 9). This section times :meth:`ModelRunner.padded_inputs`
alone (no model forward) per batch size, context bucket and path, median of repeated calls.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..kernels.dispatch import kernel_backend, triton_installed
from ..rollout.model.attention import SequenceSlice
from ..rollout.model.graph_pool import EagerBackend, GraphPool
from ..rollout.model.runner import ModelRunner
from ..testing import tiny_random_model

HOST_TITLE = "Host work before each captured replay"
BLOCK_SIZE = 16
SHAPES = [(b, c, t) for b in (1, 16, 64, 256) for c in (512, 2048) for t in (1, 5)]


@contextmanager
def _interpreted_triton():
    """``kernels="triton"`` on CPU tensors asks for Triton's interpreter; nothing here compiles a kernel."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before


def _slices(batch: int, context: int, new: int, num_blocks: int, rng: random.Random) -> list[SequenceSlice]:
    """``batch`` sequences of random cached lengths below ``context`` on shuffled blocks."""
    out = []
    for _ in range(batch):
        cached = rng.randint(context // 2, context - new)
        blocks = -(-(cached + new) // BLOCK_SIZE)
        out.append(SequenceSlice(rng.sample(range(num_blocks - 1), blocks), cached, new))
    return out


def host_ms(runner: ModelRunner, batch: int, context: int, new: int, kernels: str, repeats: int) -> float:
    """Median milliseconds of one :meth:`ModelRunner.padded_inputs` call for this shape and path."""
    seqs = _slices(batch, context, new, runner.cache.allocator.num_blocks, random.Random(batch * context + new))
    tokens = [1] * (batch * new)
    positions = [s.num_cached + r for s in seqs for r in range(s.num_new)]
    times = []
    with kernel_backend(kernels):
        key = runner.graph_key(batch, new, context)  # the split-KV path's coarser context bucket
        runner.padded_inputs(seqs, tokens, positions, key)
        for _ in range(repeats):
            start = time.perf_counter()
            runner.padded_inputs(seqs, tokens, positions, key)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def host_table(quick: bool = False) -> str:
    torch.set_num_threads(1)
    model = tiny_random_model("llama")  # the inputs depend on shapes and block tables, not on the model
    runner = ModelRunner(model, 256 * 2048 // BLOCK_SIZE + 64, BLOCK_SIZE, graph_pool=GraphPool(EagerBackend()))
    paths = ["torch", "triton"] if triton_installed() else ["torch"]
    repeats = 5 if quick else 30
    lines = [
        "| batch | context | new tokens | gather + SDPA inputs, ms | per sequence, us "
        "| block-table inputs, ms | per sequence, us |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with _interpreted_triton():
        for batch, context, new in SHAPES:
            cells = []
            for kernels in ("torch", "triton"):
                if kernels in paths:
                    ms = host_ms(runner, batch, context, new, kernels, repeats)
                    cells += [f"{ms:.3f}", f"{1000 * ms / batch:.1f}"]
                else:
                    cells += ["-", "-"]
            lines.append(f"| {batch} | {context} | {new} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_host_section(out: Path, quick: bool = False) -> str:
    from .report import replace_section

    table = host_table(quick)
    body = (
        "`ModelRunner.padded_inputs` alone (no forward): the inputs of one captured forward padded to "
        "its bucket, built with whole-array numpy operations since 2026-11-27 (before, tensor operations "
        "per sequence took 4.4 ms at batch 64 and context 512, and 20.6 ms at batch 256 and context 2k, "
        "12.2 ms with block tables, on this kind of machine). Sequences hold half to all of the context "
        "bucket on shuffled blocks of 16; one torch thread; median of 30 calls. The block-table inputs "
        "(the split-KV kernel's) pad to its coarse context buckets (2k, 8k, 32k), so the context-512 rows "
        "build 2k-wide tables. On a GPU the same work runs on the host before every replay, the target's "
        "and each drafter-LM level's; the inputs are built on the host and go to the device in one "
        "pinned copy per dtype (`StagedInputs`, since 2026-11-27), which this table does not include.\n\n"
        f"{table}"
    )
    replace_section(out, HOST_TITLE, body, "tailspec bench --section host")
    return table
