"""Settings shared by the whole test suite.

The tests run tiny models, for which intra-op threading costs far more than it saves: on a
busy 2-core machine one thread is ~10x faster than two. Set OMP_NUM_THREADS to override.
Without CUDA, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, which must be
set before the first kernel is compiled); on a CUDA machine they compile for the GPU.
Model caches and the Hugging Face greedy reference live in ``tests/rollout/rollout_helpers.py``.
"""

import os
import time

import pytest
import torch

if "OMP_NUM_THREADS" not in os.environ:
    # in the environment too: child processes inherit it, and Accelerate, finding it unset when a
    # trainer starts, raises torch's threads to the physical cores for the rest of the process
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _start_ray():
    """A new local Ray instance (2 CPUs, no dashboard). ``address="local"`` starts one even when
    another Ray cluster runs on this machine (another test run, a user's head): joining that one
    would share its state and refuse ``num_cpus``."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    return ray


def _all_cpus_free(ray, within_s: float) -> bool:
    """Whether every CPU of the instance is free again within ``within_s`` (a killed actor's
    resources come back asynchronously)."""
    deadline = time.monotonic() + within_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="session")
def _ray_instance():
    ray = pytest.importorskip("ray")
    _start_ray()
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def ray_local(_ray_instance):
    """This test process's local Ray instance, shared by its tests: starting one costs seconds, and
    the tests that use it start their own actors on it. A test that leaves an actor holding CPUs
    (a failure before its shutdown) gets the instance restarted after it, so the next test finds
    every CPU free."""
    ray = _ray_instance
    yield ray
    if not _all_cpus_free(ray, within_s=10.0):
        ray.shutdown()
        _start_ray()


# what a child process must not inherit from this test process: another Ray cluster's address or
# token settings, wandb settings, and the torch.distributed rendezvous that DeepSpeed tests leave
_NOT_INHERITED = (
    *("RAY_", "WANDB_"),
    *("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
)


@pytest.fixture
def child_env() -> dict[str, str]:
    """The environment for a child process (a Ray head, a CLI run): this one's, minus what would
    tie the child to this process's clusters or distributed group; Ray token authentication off."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)} | {"RAY_AUTH_MODE": "disabled"}


# The files that take longest (pytest --durations, summed per file), started first: with
# `make test`'s two processes (pytest-xdist, a file per process at a time) the longest files then
# do not end up as the last unit one process runs while the other idles. A schedule hint only: a
# file not listed runs after these, in collection order.
LONGEST_FIRST = (  # by their time in the last measured run; Ray's and the others alternating
    "rollout/mirror/test_mirror.py",
    "workers/test_ray_job.py",
    "rollout/test_spec_sampling.py",
    "rollout/test_spec_greedy.py",
    "drafter/eagle3/test_eagle3_drafter.py",
    "workers/test_faults.py",
    "rollout/model/test_compiled.py",
    "test_interrupt.py",
    "testing/test_selector_sim.py",
    "atts/test_ray_clients.py",
    "test_cli_and_configs.py",
    "trainer_hooks/test_deepspeed_grpo.py",
    "rollout/test_position_noise.py",
    "workers/test_coordinator.py",
    "drafter/eagle3/test_eagle3_train.py",
    "tasks/test_deep.py",
    "rollout/mirror/test_executors.py",
    "rollout/spec/test_verify.py",
)


class _Payload:
    """Unpickled, it runs code: it writes ``marker`` (what a crafted checkpoint file would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


class CraftedFiles:
    """Files that would run code if a loader unpickled them, and whether any did."""

    def __init__(self, folder) -> None:
        self.marker = folder / "payload-ran"

    def payload(self) -> _Payload:
        return _Payload(str(self.marker))

    def torch_file(self, path) -> None:
        """A ``torch.save`` of an optimizer-shaped dict with the payload inside."""
        torch.save({"state": {0: {"exp_avg": self.payload()}}, "param_groups": []}, path)

    def pickle_file(self, path) -> None:
        """A plain pickle of the payload, under whatever name ``path`` has (a .safetensors, a .yaml...)."""
        import pickle

        path.write_bytes(pickle.dumps(self.payload()))

    @property
    def ran(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def crafted(tmp_path) -> CraftedFiles:
    return CraftedFiles(tmp_path)


def _solo_files(tests_dir: str) -> set[str]:
    """The files `make test` runs the `solo` tests from (its second command collects only these)."""
    makefile = open(os.path.join(tests_dir, os.pardir, "Makefile")).read()
    line = next(line for line in makefile.splitlines() if line.startswith("SOLO_TESTS"))
    return {os.path.normpath(os.path.join(tests_dir, os.pardir, f)) for f in line.split("#")[0].split(":=")[1].split()}


def pytest_collection_modifyitems(session, config, items):
    tests_dir = os.path.dirname(__file__)
    moved = [path for path in LONGEST_FIRST if not os.path.isfile(os.path.join(tests_dir, path))]
    if moved:  # a renamed file would silently lose its place
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that are not there: {moved}")
    stray = {str(item.path) for item in items if item.get_closest_marker("solo")} - _solo_files(tests_dir)
    if stray:  # `make test` would never run them
        raise pytest.UsageError(f"`solo` tests outside the Makefile's SOLO_TESTS: {sorted(stray)}")
    rank = {os.path.join(tests_dir, path): i for i, path in enumerate(LONGEST_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(str(item.path), len(rank)), order[id(item)]))
