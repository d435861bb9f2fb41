"""``ray job submit`` of the example job against a Ray head started here on loopback (and stopped
afterwards): the job runs GRPO with 2 Ray rollout workers on that cluster and succeeds."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_submitted_example_job_succeeds(tmp_path):
    ray = str(Path(sys.executable).parent / "ray")
    # a throwaway loopback-only cluster: no token authentication, nothing inherited from outside
    # (and no torch.distributed rendezvous left in this process's environment by earlier tests)
    inherited = ("RAY_", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)} | {"RAY_AUTH_MODE": "disabled"}
    gcs, dashboard = free_port(), free_port()
    start = [
        ray,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        "--num-cpus=2",
        "--include-dashboard=true",
        "--disable-usage-stats",
    ]
    started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=300)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        entrypoint = [
            sys.executable,
            str(ROOT / "examples" / "ray_job.py"),
            "--quick",
            "--no-wandb",
            "--config",
            str(ROOT / "configs" / "ray_job_cpu.yaml"),
            "--output-dir",
            str(tmp_path / "out"),
        ]
        job = subprocess.run(
            [ray, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--", *entrypoint],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        log = job.stdout + job.stderr
        assert job.returncode == 0, log[-5000:]
        assert "succeeded" in log
        line = next(line for line in log.splitlines() if line.startswith("tailspec-job-summary "))
        summary = json.loads(line.split(" ", 1)[1])
        assert summary["steps"] == 2 and summary["workers"] == 2
        assert summary["policy_syncs"] == 1  # the second rollout saw the first optimizer step
        assert summary["workers_died"] == 0
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=300)
