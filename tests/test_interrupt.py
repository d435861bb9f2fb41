"""Ctrl-C during a GRPO run with Ray rollout workers (``tailspec demo``): the process exits within
10 s, no Ray or worker process is left behind, and the demo closes its wandb run with the
interrupt's exit code. A training script that calls ``run_demo`` itself (examples/ray_job.py)
takes the same path: the interrupt ends ``run_demo``, whose Ray workers and instance are torn
down the same way; the CLI only turns the interrupt into exit status 130."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
RAY_NAMES = ("raylet", "gcs_server", "ray::", "ray/_private", "ray.dashboard", "dashboard/agent")


def live_processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, command line) of every process that is not a zombie."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,sid=,stat=,args="], capture_output=True, text=True).stdout
    procs = {}
    for line in out.splitlines():
        pid, ppid, sid, stat, args = (line.split(None, 4) + [""])[:5]
        if not stat.startswith("Z"):
            procs[int(pid)] = (int(ppid), int(sid), args)
    return procs


def descendants(root: int) -> set[int]:
    """``root`` and every process below it now (the run's Ray head and workers: its children and
    theirs). Only these count as the run's, so Ray instances of tests running beside it do not."""
    procs, tree = live_processes(), {root}
    grown = True
    while grown:
        below = {pid for pid, (ppid, _, _) in procs.items() if ppid in tree}
        grown = not below <= tree
        tree |= below
    return tree


def interrupt_when_workers_run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, float, list[str]]:
    """Run ``cmd`` in its own session; once both Ray workers are up and the first rollout is on its
    way, send SIGINT to the session's process group as a terminal's Ctrl-C does. Returns (exit
    status, output, seconds from the signal to the exit, processes of the run still alive 10 s
    after the signal)."""
    # a shell starts background jobs with SIGINT ignored, and children inherit that (CI may run us
    # so): restore the default disposition, as a terminal's foreground job has it, then exec
    trampoline = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", trampoline, *cmd],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    workers_up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "started rollout worker 1" in line:
                workers_up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert workers_up.wait(timeout=300), "".join(lines)[-3000:]
    time.sleep(1.5)  # the first rollout is running on the workers
    run = descendants(proc.pid)
    procs = live_processes()
    ray_processes = [procs[pid][2] for pid in run if pid in procs and any(n in procs[pid][2] for n in RAY_NAMES)]
    assert any("raylet" in args for args in ray_processes), ray_processes  # the run's Ray is in view
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        status = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        status = proc.wait()
    took = time.monotonic() - sent
    reader.join(timeout=10)
    left: list[str] = []
    while time.monotonic() - sent < 10:
        left = [args for pid, (_, sid, args) in live_processes().items() if pid in run or sid == proc.pid]
        if not left:
            break
        time.sleep(0.5)
    for pid, (_, sid, _) in live_processes().items():  # never leave anything to later tests
        if pid in run or sid == proc.pid:
            os.kill(pid, signal.SIGKILL)
    return status, "".join(lines), took, left


@pytest.fixture
def env(tmp_path, child_env):
    return child_env | {"WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}


def test_ctrl_c_during_the_demo(tmp_path, env):
    config = yaml.safe_load((ROOT / "configs" / "ray_job_cpu.yaml").read_text())
    config.update(max_steps=20, baseline=False, output_dir=str(tmp_path / "out"))
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(config))
    tailspec = str(Path(sys.executable).parent / "tailspec")
    status, log, took, left = interrupt_when_workers_run(
        [tailspec, "demo", "--config", str(tmp_path / "demo.yaml")], env, tmp_path
    )
    assert status == 130, log[-3000:]
    assert took < 10 and not left, (took, left)
    assert "tailspec: interrupted" in log and "Traceback" not in log
    (debug_log,) = tmp_path.glob("wandb/offline-run-*/logs/debug.log")
    assert "got exitcode: 130" in debug_log.read_text()
