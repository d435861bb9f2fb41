import pytest
from rollout_helpers import cached_model

from tailspec.testing import ARCHITECTURES


@pytest.fixture(params=ARCHITECTURES)
def arch_model(request):
    return cached_model(request.param)
