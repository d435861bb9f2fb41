"""The draft-host benchmark's report: ratios to serial chain:4 with their spread, pairs and hosted
commands per arm, and a section that says what each arm is."""

from tailspec.benchmarks.draft_hosts import (
    ARMS,
    DraftHostBenchConfig,
    DraftHostResult,
    HostArm,
    draft_hosts_section,
    draft_hosts_table,
    plot_draft_hosts,
)


def _result() -> DraftHostResult:
    base = HostArm("chain:4", [10.0, 12.0], [1000, 1000], [4.0, 5.0], [1.0, 1.0], accept_length=3.0)
    hosted = HostArm(
        "mirror inline + draft hosts", [8.0, 12.0], [1000, 1000], [3.0, 4.0], [1.25, 1.0], 2, 340, accept_length=3.1
    )
    return DraftHostResult(DraftHostBenchConfig(passes=2), "a policy", [base, hosted], round_trip_ms=0.7)


def test_table_and_section(tmp_path):
    result = _result()
    table = draft_hosts_table(result)
    assert "| chain:4 | 92 | 1.00x (1.00-1.00) | 4.5 | 3.00 | 0 | 0 |" in table
    assert "| mirror inline + draft hosts | 104 | 1.12x (1.00-1.25) | 3.5 | 3.10 | 2 | 340 |" in table
    section = draft_hosts_section(result, "plot.png")
    assert "0.70 ms" in section and "![draft hosts](plot.png)" in section
    plot_draft_hosts(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_arms_differ_only_in_where_the_mirror_drafts():
    assert ARMS["mirror inline"][:2] == ARMS["mirror inline + draft hosts"][:2]
    assert [hosts for _, _, hosts in ARMS.values()] == [False, False, True, False]
