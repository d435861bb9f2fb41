"""A throwaway Ray head on loopback for the tests that need a running cluster, stopped afterwards."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tailspec.distributed import free_ports

_PORT_CLASH = re.compile(r"address already in use|port .* is (already )?(in use|used)|trying to use a port", re.I)


class _PortTaken(RuntimeError):
    """The head exited because a port picked for it was taken before it bound it."""


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
            output = process.stdout.read()[-3000:]
            failure = _PortTaken if _PORT_CLASH.search(output) else RuntimeError
            raise failure(f"ray start exited with {process.returncode}: {output}")
        try:
            with urllib.request.urlopen(f"{head.dashboard}/api/version", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the Ray head's dashboard did not come up")


def _start_head(ray: str, env: dict[str, str]) -> tuple[RayHead, subprocess.Popen]:
    # Ray's fixed defaults (52365, 10001) could be among the free ports picked: pick every port
    gcs, dashboard, agent, client = free_ports(4)
    head = RayHead(ray, env, gcs, dashboard)
    start = [
        ray,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}",
        f"--ray-client-server-port={client}",
        "--num-cpus=2",
        "--include-dashboard=true",
        "--disable-usage-stats",
    ]
    process = subprocess.Popen(
        start, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        _wait_for_dashboard(head, process)
    except BaseException:
        _stop(process)
        raise
    return head, process


def _stop(process: subprocess.Popen) -> None:
    # ``ray start --block`` outlived 15 s of SIGINT or SIGTERM on every teardown (30 s of each test
    # run); its whole process group ends at once on SIGKILL and leaves no Ray process behind
    for sig, grace in ((signal.SIGTERM, 2), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def ray_head(child_env):
    """``ray start --head --block`` in its own process group, stopped by signalling that group:
    only this head's processes end (``ray stop`` would end every Ray instance on the machine).
    Another process can take a picked port before the head binds it: then the head starts again
    on fresh ports (three tries)."""
    pytest.importorskip("ray")
    ray = str(Path(sys.executable).parent / "ray")
    for attempt in range(3):
        try:
            head, process = _start_head(ray, child_env)
            break
        except _PortTaken:
            if attempt == 2:
                raise
    try:
        yield head
    finally:
        _stop(process)
