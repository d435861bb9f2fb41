"""A throwaway Ray head on loopback for the tests that need a running cluster, stopped afterwards."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tailspec.distributed import free_port


@dataclass(frozen=True)
class RayHead:
    ray: str  # the ``ray`` executable of this venv
    env: dict[str, str]
    gcs_port: int
    dashboard_port: int

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"


def _wait_for_dashboard(head: "RayHead", process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}: {process.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{head.dashboard}/api/version", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the Ray head's dashboard did not come up")


@pytest.fixture
def ray_head(child_env):
    """``ray start --head --block`` in its own process group, stopped by signalling that group:
    only this head's processes end (``ray stop`` would end every Ray instance on the machine)."""
    pytest.importorskip("ray")
    ray = str(Path(sys.executable).parent / "ray")
    head = RayHead(ray, child_env, free_port(), free_port())
    start = [
        ray,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={head.gcs_port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={head.dashboard_port}",
        # Ray's fixed defaults (52365, 10001) could be the free ports picked above: pick these too
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        "--num-cpus=2",
        "--include-dashboard=true",
        "--disable-usage-stats",
    ]
    process = subprocess.Popen(
        start, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        _wait_for_dashboard(head, process)
        yield head
    finally:
        for sig, grace in ((signal.SIGINT, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=grace)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
