"""The kernel benchmark's measurements and tables, on tiny shapes in Triton's interpreter (its
timings mean nothing here; the checks it reports must hold)."""

import pytest
import torch

from tailspec.benchmarks.kernels import NO_CUDA_SECTION, kernels_section, run_kernel_bench
from tailspec.testing import perturbed_copy, tiny_random_model

pytest.importorskip("triton")


def test_quick_kernel_bench_checks_and_reports():
    model = tiny_random_model("qwen3", seed=2)
    drafter = perturbed_copy(model, noise=0.2, seed=3)
    timings, engine = run_kernel_bench(torch.device("cpu"), model, [[5, 6, 7], [8, 9]], [1], drafter, quick=True)
    assert [t.kernel for t in timings] == ["verify (sampled)"] * 2 + ["paged attention"] * 2
    assert all(t.torch_ms > 0 and t.triton_ms > 0 for t in timings)
    assert all(t.max_abs_diff == 0 for t in timings if t.kernel.startswith("verify"))  # identical verdicts
    assert all(t.max_abs_diff < 1e-4 for t in timings)
    assert [e.strategy for e in engine] == ["none", "chain:4"] and all(e.same_output for e in engine)
    section = kernels_section(timings, engine, "interpreter")
    assert section.count("\n| ") == len(timings) + len(engine) + 2  # two header rows
    assert "no CUDA device" in NO_CUDA_SECTION
