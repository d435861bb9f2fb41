"""The GPU check's stages run in forked children: their output lands in the stage's log, a stage
past its time is killed with the processes it started, and a child whose fork cannot use CUDA
runs the stage in a fresh interpreter instead."""

import os
import subprocess
import sys
import time

import torch

from tailspec.benchmarks.gpu import stage_process


def test_a_stage_writes_its_log_and_its_own_children_write_there_too(tmp_path):
    log = tmp_path / "stage.log"

    def run():
        print("from the stage", flush=True)
        subprocess.run([sys.executable, "-c", "print('from its child')"], check=True)

    assert stage_process.run_forked(run, [sys.executable, "-c", "pass"], log, timeout_s=60) is None
    assert log.read_text().splitlines() == ["from the stage", "from its child"]


def test_a_stage_past_its_time_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"

    def run():
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        pid_file.write_text(str(grandchild.pid))
        time.sleep(600)

    started = time.monotonic()
    why = stage_process.run_forked(run, [sys.executable, "-c", "pass"], tmp_path / "log", timeout_s=3)
    assert why == "killed after 3 s" and time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_a_fork_that_cannot_use_cuda_runs_the_stage_in_a_fresh_interpreter(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)  # as after CUDA's driver started here
    log = tmp_path / "stage.log"

    def run():
        print("forked", flush=True)

    fresh = [sys.executable, "-c", "import os; print('fresh', os.getpid())"]
    assert stage_process.run_forked(run, fresh, log, timeout_s=120) is None
    assert log.read_text().startswith("fresh ") and "forked" not in log.read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}/stat") else "X"
    return stat != "Z"  # a killed orphan waits as a zombie until init reaps it
