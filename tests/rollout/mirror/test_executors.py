"""Switching a mirror engine's drafting to a peer's draft host and back, mid-generation, loses no
token; a failed peer hands drafting back to the engine's own executor; a sequenced host answers
commands in the order they were sent, whatever order they arrive in."""

import threading
import time

import pytest
import torch
from backend_probe import BACKENDS, BackendProbe
from rollout_helpers import cached_model, random_prompts
from test_spec_greedy import good_drafter

from tailspec.drafter.small_lm import SmallLMDrafter
from tailspec.kernels.dispatch import kernel_backend
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.mirror.executors import ExecutorError, InlineExecutor, ThreadExecutor
from tailspec.rollout.mirror.hosted import SequencedHost
from tailspec.rollout.params import MirrorConfig

ARCH = "llama"


def _engine(strategy: str = "mirror:chain:3,k=1") -> RolloutEngine:
    config = RolloutConfig(strategy=strategy, mirror=MirrorConfig(executor="inline"))
    return RolloutEngine(cached_model(ARCH), config, drafter=good_drafter(ARCH))


def _run(engine: RolloutEngine, prompts, params, switch_at: dict[int, object]) -> list[list[int]]:
    """Generate step by step, handing ``switch_at[step]`` to ``use_draft_executor`` before that step."""
    ids = [engine.add_request(p, params) for p in prompts]
    step = 0
    while engine.has_unfinished():
        if step in switch_at:
            engine.drafters.mirror.use_executor(switch_at[step])
        engine.step()
        step += 1
    return [engine.pop_output(i).completion_ids for i in ids]


class _CountingPeer(InlineExecutor):
    started = 0

    def start(self, requests, shape):
        self.started += 1
        super().start(requests, shape)


def test_drafting_moves_to_a_peer_and_back_without_changing_a_token():
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    want = [o.completion_ids for o in RolloutEngine(cached_model(ARCH), RolloutConfig()).generate(prompts, params)]
    engine = _engine()
    peer = _CountingPeer(SmallLMDrafter(good_drafter(ARCH)))  # a fresh drafter: no state of the sequences
    got = _run(engine, prompts, params, {3: peer, 8: None})
    assert got == want
    pipeline = engine.drafters.mirror.pipeline
    assert pipeline.stats.executor_switches == 2 and pipeline.executor is not peer
    assert 0 < peer.started <= 2 * 5  # branches (continuations, early-exit guesses) in steps 3-7 only
    assert engine.stats.accepted_tokens > 0


class _DeadPeer(InlineExecutor):
    def start(self, requests, shape):
        raise ExecutorError("the peer is gone")


def test_a_failed_peer_hands_drafting_back_to_the_engine_s_own_executor():
    prompts = random_prompts(3, seed=7)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    want = [o.completion_ids for o in RolloutEngine(cached_model(ARCH), RolloutConfig()).generate(prompts, params)]
    engine = _engine()
    own = None

    def remember_own():
        nonlocal own
        own = engine.drafters.mirror.pipeline.executor

    remember_own()
    got = _run(engine, prompts, params, {2: _DeadPeer(SmallLMDrafter(good_drafter(ARCH)))})
    assert got == want
    pipeline = engine.drafters.mirror.pipeline
    assert pipeline.stats.executor_failures == 1
    assert pipeline.executor is own and not pipeline.failed  # mirror steps go on, on its own executor


def test_an_engine_without_mirror_steps_ignores_a_peer():
    engine = _engine(strategy="chain:3")
    assert not engine.drafters.mirror.hostable
    engine.drafters.mirror.use_executor(InlineExecutor(SmallLMDrafter(good_drafter(ARCH))))
    engine.generate(random_prompts(2, seed=1), SamplingParams(max_new_tokens=8, temperature=0.0))
    assert engine.drafters.mirror.pipeline is None


def test_a_sequenced_host_handles_commands_in_the_order_they_were_sent():
    class Recorder:
        def __init__(self):
            self.seen = []

        def release(self, seq_id):
            self.seen.append(seq_id)

    recorder = Recorder()
    host = SequencedHost(lambda: recorder, wait_s=5)
    threads = [threading.Thread(target=host.handle, args=(n, "release", (n,))) for n in (3, 1, 2, 0)]
    for t in threads:
        t.start()
        time.sleep(0.01)  # later numbers arrive first
    for t in threads:
        t.join()
    assert recorder.seen == [0, 1, 2, 3]
    with pytest.raises(ExecutorError, match="arrived twice"):
        host.handle(2, "release", (2,))
    with pytest.raises(ExecutorError, match="waited"):
        SequencedHost(lambda: recorder, wait_s=0.05).handle(1, "release", (1,))


def test_a_drafter_that_cannot_be_rebuilt_elsewhere_is_refused_a_process_by_name():
    from tailspec.rollout.mirror.drafter import make_executor

    drafter = SmallLMDrafter(good_drafter(ARCH))
    for kind in ("process", "ray"):
        with pytest.raises(ValueError, match=f"executor '{kind}' cannot run the small_lm drafter in another process"):
            make_executor(kind, drafter, None, torch.device("cpu"), None, 1)


# a user's training script written without ``if __name__ == "__main__":``
NO_MAIN_GUARD = """
import time
print("TOP-LEVEL RAN", flush=True)
from tailspec.rollout import RolloutConfig, RolloutEngine, SamplingParams
from tailspec.rollout.params import MirrorConfig
from tailspec.testing import perturbed_copy, random_prompts, tiny_random_model

model = tiny_random_model("llama", seed=1)
config = RolloutConfig(strategy="mirror:chain:3,k=1", mirror=MirrorConfig(executor="process"))
engine = RolloutEngine(model, config, drafter=perturbed_copy(model, 0.3, seed=7))
out = engine.generate(random_prompts(3, seed=2), SamplingParams(temperature=0.0, max_new_tokens=8))
print("DONE", type(engine.drafters.mirror.pipeline.executor).__name__, len(out), flush=True)
print("CHILD", engine.drafters.mirror.pipeline.executor._process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_a_script_without_a_main_guard_runs_its_top_level_once_and_its_draft_process_dies_with_it(tmp_path, child_env):
    """The draft process starts without importing the user's script: a script without
    ``if __name__ == "__main__":`` would otherwise run again inside the child (its whole training,
    a second time) and could leave the parent waiting for that child forever. Killed outright
    (SIGKILL: no atexit, no daemon clean-up), the script leaves no draft process behind: the child
    reads the parent's end of the pipe and leaves at its EOF."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(NO_MAIN_GUARD)
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=child_env,
    )
    try:
        lines = [parent.stdout.readline() for _ in range(3)]
        assert lines[-1].startswith("CHILD"), (lines, parent.poll() is not None and parent.stderr.read()[-3000:])
        assert lines[0] == "TOP-LEVEL RAN\n" and lines[1] == "DONE ProcessExecutor 3\n"
        child = int(lines[-1].split()[1])
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "the draft process outlived its parent"
        assert "TOP-LEVEL RAN" not in parent.stdout.read()  # nothing ran the script again
    finally:
        parent.kill()


def test_a_draft_process_that_dies_while_starting_is_an_error_within_seconds():
    """No wait for the start timeout (300 s): the child's end of the pipe closes with it."""
    import functools
    import os

    from tailspec.rollout.mirror.process_executor import ProcessExecutor

    with pytest.raises(ExecutorError, match=r"died \(exit code 3\)"):  # not "did not start within"
        ProcessExecutor(functools.partial(os._exit, 3), start_timeout_s=3600)


@pytest.mark.parametrize("forced", ["torch", "triton"])
def test_a_draft_thread_runs_under_the_engines_kernel_backend(forced):
    """The engine enters ``kernel_backend(RolloutConfig.kernels)`` on its own thread: a mirror
    draft thread drafts under the same choice (a context variable a plain thread would not see)."""
    if forced == "triton":
        pytest.importorskip("triton")
    executor = ThreadExecutor(BackendProbe())  # type: ignore[arg-type]
    try:
        with kernel_backend(forced):
            executor.start([], None)
        assert [t.tokens for t in executor.finish()] == [[BACKENDS.index(forced)]]
    finally:
        executor.close()


def test_a_draft_process_and_a_peer_host_draft_under_the_engines_kernel_backend():
    """A process (or a Ray actor, or a peer worker's host thread) starts without the engine's
    context: the executor hands it ``RolloutConfig.kernels``, under which every command runs
    (``torch``: where nothing is forced, a CUDA call's attention resolves to the Triton kernel)."""
    forced = "torch"
    from tailspec.rollout.mirror.process_executor import ProcessExecutor

    process = ProcessExecutor(BackendProbe, kernels=forced)  # type: ignore[arg-type]
    try:
        process.start([], None)
        assert [t.tokens for t in process.finish()] == [[BACKENDS.index(forced)]]
    finally:
        process.close()
    peer = SequencedHost(BackendProbe, kernels=forced)  # type: ignore[arg-type]
    answered = []
    thread = threading.Thread(target=lambda: answered.extend(peer.handle(0, "branches", ([], None))))
    thread.start()
    thread.join()
    assert [t.tokens for t in answered] == [[BACKENDS.index(forced)]]
