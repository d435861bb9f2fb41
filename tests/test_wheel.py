"""The built wheel holds the library: engine, drafters, workers, TRL glue, kernels, configs and the
CLI; not the chain-sum task and its recipes, the shipped weights or the benchmark harness, which
`make demo` and `make bench` run from the checkout. Built from a copy of the tracked files."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from package_imports import imported_units

ROOT = Path(__file__).resolve().parent.parent
CHECKOUT_ONLY = {"tasks", "assets", "benchmarks"}
MAX_WHEEL_BYTES = 2 << 20


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in tracked.splitlines():
        if (ROOT / name).is_file():  # a file deleted in the working tree is not built
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    build = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("tailspec-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_the_library_and_none_of_the_checkouts_harness(wheel):
    names = wheel.namelist()
    units = {n.split("/")[1] for n in names if n.startswith("tailspec/") and n.count("/") >= 2}
    assert units >= {"rollout", "drafter", "trainer_hooks", "workers", "atts", "kernels", "configs"}
    assert not units & (CHECKOUT_ONLY | {"tests", "examples", "docs"}), sorted(units)
    for module in (
        "cli.py",
        "rollout/engine.py",
        "drafter/eagle3/model.py",
        "trainer_hooks/spec_rollout.py",
        "workers/coordinator.py",
        "configs/demo_cpu.yaml",
        "configs/deepspeed_zero3.json",
    ):
        assert f"tailspec/{module}" in names, module
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
