"""The GPU check's driver: --budget gives the named stages a shorter budget (a stage skips what no
longer fits, by name, and keeps what ran); --within bounds the whole run (a stage gets what is
left, or is left out by name); a bad value or stage is refused."""

import json
import subprocess
import sys

import pytest

from tailspec.benchmarks.gpu.__main__ import GRACE_S, PACK, SHORTEST_STAGE_S, START_S, main, stage_seconds


def test_a_budget_below_every_part_skips_them_by_name_and_keeps_the_report(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "tailspec.benchmarks.gpu", "--rehearse", "--stages", "env", "--budget", "0.5"]
    subprocess.run([*command, "--out", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads((out / "results.json").read_text())["env"]
    assert report["budget_s"] == 0.5 and report["status"] == "partial"
    assert {s["name"] for s in report["skipped"]} >= {"copy bandwidth", "bf16 matrix rate"}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--budget", "0"], "--budget must be > 0"),
        (["--within", "-5"], "--within must be > 0"),
        (["--stages", "nope"], "unknown"),
    ],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert match in capsys.readouterr().err


def test_within_gives_a_stage_what_is_left_and_leaves_out_one_it_cannot_fit():
    assert stage_seconds(200, None, 1000) == 200  # no bound: its own budget
    assert stage_seconds(200, 600, 100) == 200  # room enough
    reserve = GRACE_S + START_S
    assert stage_seconds(200, 600, 400) == pytest.approx(200 - reserve)  # what is left
    assert stage_seconds(200, 600, 600 - reserve - SHORTEST_STAGE_S + 1) is None  # too little: left out


def test_a_run_within_too_little_leaves_the_pack_out_by_name(tmp_path):
    out = tmp_path / "out"
    assert main(["--rehearse", "--stages", "pack", "--within", "1", "--out", str(out)]) == 0
    reports = json.loads((out / "results.json").read_text())
    assert list(reports) == list(PACK)  # "pack": the stages of make gpu-check, in order
    assert all(r["status"] == "left out" and r["skipped"][0]["name"] == name for name, r in reports.items())
    assert "left out" in (out / "summary.md").read_text()


def test_gpu_tests_cut_at_their_budget_still_say_which_tests_ended(tmp_path, monkeypatch):
    from tailspec.benchmarks.gpu import gpu_tests
    from tailspec.benchmarks.gpu.common import CheckSize, Stage

    verbose = (
        "tests/a.py::test_one PASSED                 [ 10%]\n"
        "tests/a.py::test_two[llama-keyed] FAILED    [ 20%]\n"
        "tests/b.py::test_three SKIPPED (two GPUs)   [ 30%]\n"
        "tests/b.py::test_four "
    )

    def cut(command, **kwargs):
        assert "-v" in command  # a line per test as it ends
        raise subprocess.TimeoutExpired(command, kwargs["timeout"], output=verbose.encode(), stderr=b"")

    monkeypatch.setattr(gpu_tests.subprocess, "run", cut)
    stage = Stage("gpu_tests", CheckSize.of("tiny"), 20, tmp_path)
    gpu_tests.run(stage)
    report = stage.report
    assert report.results["outcomes"] == {
        "tests/a.py::test_one": "PASSED",
        "tests/a.py::test_two[llama-keyed]": "FAILED",
        "tests/b.py::test_three": "SKIPPED",
    }
    (check,) = report.checks
    assert not check["passed"] and "1 failed, 1 passed, 1 skipped" in check["detail"]
