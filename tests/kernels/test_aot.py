"""The kernels compile for real GPU architectures (Triton's bundled ptxas, no GPU needed): the
interpreter that runs them in the other tests does not check that they are valid compiled Triton."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


# the lent H100/H200; `--arch 80` compiles the same sources for an A100. Attention's fp16 variants
# are bf16's with another 16-bit element type (`python -m tailspec.kernels.aot` compiles them too)
@pytest.mark.parametrize("arch", [90])
def test_every_kernel_variant_compiles(arch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a warm cache
    args = ["--arch", str(arch), "--head-dim", "64", "--dtypes", "fp32,bf16"]
    out = subprocess.run(
        [sys.executable, "-m", "tailspec.kernels.aot", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    sizes = json.loads(out.stdout)
    assert "verify" in sizes and sum(k.startswith("attention[") for k in sizes) == 8
    assert sum(k.startswith("split_kv[") for k in sizes) == 4 and "split_kv[bf16,1 new,sinks,softcap]" in sizes
    assert "merge_splits" in sizes and "merge_splits[sinks]" in sizes
    assert all(size > 1000 for size in sizes.values())


def test_unknown_dtypes_are_refused():
    from tailspec.kernels.aot import compile_kernels

    with pytest.raises(ValueError, match="dtypes must be a non-empty subset"):
        compile_kernels(90, dtypes=("fp8",))


def test_refuses_to_run_interpreted(monkeypatch):
    from tailspec.kernels.aot import compile_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_kernels(90)
