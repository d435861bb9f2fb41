import socket

import pytest

from tailspec.distributed import free_ports, single_process_deepspeed

LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_launcherless_deepspeed_run_is_one_process_without_the_shared_memory_op(monkeypatch):
    """DeepSpeed's CPU shared-memory all-reduce (a C++ build at its first init) has no peer in one
    process: it is marked unavailable, and a launcher's settings are left as they are."""
    deepspeed = pytest.importorskip("deepspeed")
    for name in LAUNCHER_VARIABLES:  # set, then removed: undone afterwards, what the call sets goes too
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    values = single_process_deepspeed()
    assert values["WORLD_SIZE"] == "1" and values["RANK"] == "0"
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    assert single_process_deepspeed() == {}  # a launcher's run: RANK is set
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is True
