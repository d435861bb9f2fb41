"""Backend choice: on CUDA Triton verification and torch attention, torch elsewhere, and the overrides
in their order."""

import pytest
import torch

from tailspec.kernels import dispatch
from tailspec.kernels.dispatch import kernel_backend, resolve_backend
from tailspec.rollout import RolloutConfig

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu_and_the_faster_kernel_on_cuda(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "triton_installed", lambda: True)
    assert resolve_backend(CPU) == "torch"
    assert resolve_backend(torch.device("cuda"), kernel="verify") == "triton"
    assert resolve_backend(torch.device("cuda"), kernel="attention") == "torch"  # slower on an H100 (GPU.md)
    assert resolve_backend(torch.device("cuda"), "triton", kernel="attention") == "triton"
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    assert resolve_backend(torch.device("cuda"), kernel="verify") == "torch"


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
