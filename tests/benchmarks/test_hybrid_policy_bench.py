"""The hybrid-policy section's table: same-pass speedups over `none` per policy and workload."""

from tailspec.benchmarks.adaptive import RunResult
from tailspec.benchmarks.hybrid_policy import PolicyRuns, hybrid_policy_table


def _run(name: str, passes: list[float]) -> RunResult:
    return RunResult(name, sum(passes), 100 * len(passes), pass_seconds=passes)


def test_each_row_gives_the_median_and_spread_of_same_pass_ratios():
    results = [
        _run("none", [2.0, 3.0, 2.0]),
        _run("chain:4", [1.0, 1.0, 2.0]),
        _run("adaptive (cold)", [4.0]),
        _run("adaptive (warm)", [1.0, 2.0, 1.0]),
    ]
    table = hybrid_policy_table([PolicyRuns("hybrid", "batch 1", results, 3.25)])
    row = table.splitlines()[-1]
    assert row == "| hybrid | batch 1 | 43 | 2.00x (1.00-3.00) | 3.25 | 2.00x (1.50-2.00) |"
