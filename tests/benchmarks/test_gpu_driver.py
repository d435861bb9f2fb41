"""The GPU check's driver: --budget gives the named stages a shorter budget (a stage skips what no
longer fits, by name, and keeps what ran); a bad value or stage is refused."""

import json
import subprocess
import sys

import pytest

from tailspec.benchmarks.gpu.__main__ import main


def test_a_budget_below_every_part_skips_them_by_name_and_keeps_the_report(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tailspec.benchmarks.gpu", "--rehearse", "--stages", "env", "--budget", "0.5"]
    subprocess.run([*command, "--out", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads((out / "results.json").read_text())["env"]
    assert report["budget_s"] == 0.5 and report["status"] == "partial"
    assert {s["name"] for s in report["skipped"]} >= {"copy bandwidth", "bf16 matrix rate"}


@pytest.mark.parametrize(
    "argv, match", [(["--budget", "0"], "--budget must be > 0"), (["--stages", "nope"], "unknown")]
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert match in capsys.readouterr().err
