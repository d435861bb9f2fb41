"""Backend choice: on CUDA Triton verification, and Triton attention for 16-bit decode and
verification (torch for prefills and fp32), torch elsewhere, and the overrides in their order."""

import pytest
import torch

from tailspec.kernels import dispatch
from tailspec.kernels.dispatch import SPLIT_KV_MAX_NEW, attention_suits_triton, kernel_backend, resolve_backend
from tailspec.rollout import RolloutConfig

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu_and_the_faster_kernel_on_cuda(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    assert resolve_backend(CPU) == "torch"
    assert resolve_backend(torch.device("cuda"), kernel="verify") == "triton"
    assert resolve_backend(torch.device("cuda"), kernel="attention") == "triton"
    # attention that does not suit the split-KV kernel (a prefill, fp32) stays on torch unless forced
    assert resolve_backend(torch.device("cuda"), kernel="attention", triton_suits=False) == "torch"
    assert resolve_backend(torch.device("cuda"), "triton", kernel="attention", triton_suits=False) == "triton"
    assert resolve_backend(CPU, kernel="attention", triton_suits=True) == "torch"
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    assert resolve_backend(torch.device("cuda"), kernel="verify") == "torch"


def test_attention_suits_triton_for_16_bit_decode_and_verification():
    for dtype in (torch.bfloat16, torch.float16):
        assert attention_suits_triton(dtype, 1) and attention_suits_triton(dtype, SPLIT_KV_MAX_NEW)
        assert not attention_suits_triton(dtype, SPLIT_KV_MAX_NEW + 1)  # a prefill
    assert not attention_suits_triton(torch.float32, 1)  # 3.5x slower than torch in fp32 (GPU.md, run 9)


def test_overrides_most_specific_first(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert resolve_backend(CPU) == "triton"
    with kernel_backend("torch"):
        assert resolve_backend(CPU) == "torch"
        assert resolve_backend(CPU, "triton") == "triton"
        with kernel_backend("auto"):  # auto defers to the enclosing choice
            assert resolve_backend(CPU) == "torch"
        with kernel_backend("triton", kernels=("verify",)):
            assert resolve_backend(CPU, kernel="verify") == "triton"
            assert resolve_backend(CPU, kernel="attention") == "torch"
    assert resolve_backend(CPU) == "triton"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend(CPU, "triton")
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        resolve_backend(CPU, "triton")


def test_bad_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        resolve_backend(CPU, "cuda")
    with pytest.raises(ValueError, match="subset"):
        with kernel_backend("torch", kernels=("matmul",)):
            pass
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="kernel backend"):
        resolve_backend(CPU)
    with pytest.raises(ValueError, match="kernels must be"):
        RolloutConfig(kernels="cuda")
