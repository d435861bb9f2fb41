"""A throwaway Ray head on loopback for the tests that need a running cluster, stopped afterwards."""

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# nothing inherited from outside: no token authentication, no address of another cluster, and no
# torch.distributed rendezvous left in this process's environment by earlier tests
_INHERITED = ("RAY_", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RayHead:
    ray: str  # the ``ray`` executable of this venv
    env: dict[str, str]
    gcs_port: int
    dashboard_port: int

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"


@pytest.fixture
def ray_head():
    pytest.importorskip("ray")
    ray = str(Path(sys.executable).parent / "ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith(_INHERITED)} | {"RAY_AUTH_MODE": "disabled"}
    head = RayHead(ray, env, free_port(), free_port())
    start = [
        ray,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={head.gcs_port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={head.dashboard_port}",
        "--num-cpus=2",
        "--include-dashboard=true",
        "--disable-usage-stats",
    ]
    started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        yield head
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=300)
