"""A one-process torch.distributed group for runs that no launcher started (DeepSpeed needs one)."""

from __future__ import annotations

import contextlib
import os
import socket


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports: every socket stays bound until all are chosen, so
    the kernel cannot hand the same port out twice (it may, to sockets bound one after another)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def single_process_environment() -> dict[str, str]:
    """Set the torch.distributed variables for a one-process run where no launcher set them (a
    free port, so concurrent runs on one machine do not collide); returns what was set (empty
    under a launcher)."""
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return {}
    values = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    for key, value in values.items():
        os.environ.setdefault(key, value)
    return values


def single_process_deepspeed() -> dict[str, str]:
    """:func:`single_process_environment` for DeepSpeed. On a CPU, DeepSpeed compiles a
    shared-memory all-reduce (a C++ op: about a minute on 2 cores) at its first initialization;
    one process has no peer to share memory with, so the op is marked unavailable and
    torch.distributed's own collectives serve. Under a launcher nothing changes."""
    values = single_process_environment()
    if os.environ.get("WORLD_SIZE") == "1":
        import deepspeed.ops
        import torch

        if not torch.cuda.is_available():
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return values
