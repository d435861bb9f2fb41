"""The built wheel holds the library: engine, drafters, workers, TRL glue, kernels, configs and the
CLI; not the chain-sum task and its recipes, the shipped weights or the benchmark harness, which
`make demo` and `make bench` run from the checkout. Built from a copy of the tracked files; that
it installs and imports where the checkout is not, and generates, is `make wheel-check`."""

import zipfile

import pytest
from package_imports import imported_units
from wheel_check import build_wheel, checkout_only, missing_from

CHECKOUT_ONLY = set(checkout_only())
MAX_WHEEL_BYTES = 2 << 20


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    return zipfile.ZipFile(build_wheel(tmp_path_factory.mktemp("dist")))


def test_the_wheel_holds_the_library_and_none_of_the_checkouts_harness(wheel):
    names = wheel.namelist()
    assert not missing_from(wheel), missing_from(wheel)  # every tracked module and config of the library
    units = {n.split("/")[1] for n in names if n.startswith("tailspec/") and n.count("/") >= 2}
    assert not units & CHECKOUT_ONLY, sorted(units)
    assert "tailspec/setup.py" not in names
    assert not [n for n in names if n.endswith((".safetensors", ".xz", ".pt", ".bin"))]
    size = sum(info.file_size for info in wheel.infolist())
    assert size < MAX_WHEEL_BYTES, size
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "tailspec = tailspec.cli:main" in wheel.read(entry_points).decode()


def test_the_library_in_the_wheel_imports_nothing_left_in_the_checkout(wheel):
    """Only the CLI and the demo reach the task, weights and harness, and the CLI refuses in one line
    what needs them outside a checkout (``cli._from_checkout``)."""
    wrong = []
    for name in wheel.namelist():
        if name.endswith(".py") and name not in ("tailspec/cli.py", "tailspec/demo.py"):
            package = name.removesuffix(".py").split("/")[:-1]
            reached = imported_units(wheel.read(name).decode(), package) & CHECKOUT_ONLY
            if reached:
                wrong.append(f"{name} imports {sorted(reached)}")
    assert not wrong, "\n".join(wrong)


def test_a_wheel_that_lacks_a_package_is_caught_naming_its_files(wheel, tmp_path):
    cut = zipfile.ZipFile(tmp_path / "cut.whl", "w")
    for name in wheel.namelist():
        if not name.startswith("tailspec/rollout/adaptive/"):
            cut.writestr(name, wheel.read(name))
    cut.close()
    missing = missing_from(zipfile.ZipFile(tmp_path / "cut.whl"))
    assert "tailspec/rollout/adaptive/selector.py" in missing
    assert all(name.startswith("tailspec/rollout/adaptive/") for name in missing)
