"""``ray job submit`` of the example job against a Ray head started here on loopback (and stopped
afterwards): the job runs GRPO with 2 Ray rollout workers on that cluster and succeeds. And a
process given no address starts its own Ray instance beside that head instead of joining it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


def test_a_submitted_job_succeeds_and_a_process_without_an_address_starts_its_own_instance(tmp_path, ray_head):
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
    # one head serves both (a head costs seconds): while the job runs, a process given no address
    # beside it (both mostly wait on Ray starting up, so they share the time)
    probe = (
        "import ray\n"
        "from tailspec.workers.coordinator import ensure_ray\n"
        "ensure_ray(num_cpus=1)\n"
        "print('gcs', ray.get_runtime_context().gcs_address)\n"
        "ray.shutdown()\n"
    )
    alone = subprocess.Popen(
        [sys.executable, "-c", probe], env=ray_head.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    job = subprocess.run(
        [ray_head.ray, "job", "submit", "--address", ray_head.dashboard, "--", *entrypoint],
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out, err = alone.communicate(timeout=300)
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-5000:]
    assert "succeeded" in log
    line = next(line for line in log.splitlines() if line.startswith("tailspec-job-summary "))
    summary = json.loads(line.split(" ", 1)[1])
    assert summary["steps"] == 2 and summary["workers"] == 2
    assert summary["policy_syncs"] == 1  # the second rollout saw the first optimizer step
    assert summary["workers_died"] == 0

    assert alone.returncode == 0, err[-3000:]
    gcs = next(line.split()[1] for line in out.splitlines() if line.startswith("gcs "))
    assert not gcs.endswith(f":{ray_head.gcs_port}")
