"""A CPU engine raises glibc's mmap and trim thresholds once per process, unless the user set them."""

import platform

import pytest

from tailspec.rollout.model import host_memory


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def fake_libc(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(host_memory, "_glibc", lambda: libc)
    monkeypatch.setattr(host_memory, "_applied", None)
    for name in host_memory.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return libc


def test_a_cpu_engine_raises_the_thresholds_once(fake_libc):
    assert not host_memory.keep_freed_host_memory("cuda") and not fake_libc.calls  # a GPU engine: untouched
    assert host_memory.keep_freed_host_memory("cpu")
    assert fake_libc.calls == [(host_memory.M_MMAP_THRESHOLD, 32 << 20), (host_memory.M_TRIM_THRESHOLD, 1 << 30)]
    assert host_memory.keep_freed_host_memory("cpu") and len(fake_libc.calls) == 2  # once per process


def test_the_users_own_malloc_settings_win(fake_libc, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert not host_memory.keep_freed_host_memory("cpu") and not fake_libc.calls


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_is_found_here():
    assert host_memory._glibc() is not None
