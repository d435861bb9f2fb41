import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for the module's tests (2 CPUs, no dashboard), stopped afterwards."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        yield ray
    finally:
        ray.shutdown()
