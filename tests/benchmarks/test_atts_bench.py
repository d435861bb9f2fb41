"""`tailspec atts`: every contender runs on the same questions and the report section is written."""

import pytest

from tailspec.benchmarks.atts import ATTSBenchConfig
from tailspec.cli import main


def test_atts_cli_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Other section\n\nkept\n")
    argv = ["atts", "--questions", "3", "--calibration-questions", "3", "--samples", "2", "--alphas", "0.4"]
    assert main([*argv, "--max-new-tokens", "32", "--chunk-tokens", "8", "--delimiter", " ", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("target only", "draft only", "ATTS async (split)", "ATTS async (online)", "synchronous baseline"):
        assert f"| {name} |" in printed
    assert printed.count("| ATTS async (split) |") == 2  # alphas 0.2 and 0.4
    text = out.read_text()
    assert "## Other section\n\nkept" in text
    assert "## ATTS: asynchronous test-time scaling with conformal takeover" in text
    assert "Measured by `tailspec atts --questions 3" in text
    assert (tmp_path / "bench_atts.png").stat().st_size > 0


def test_bad_bench_config_is_refused(capsys):
    with pytest.raises(ValueError, match="main_alpha"):
        ATTSBenchConfig(alphas=(0.1,), main_alpha=0.2)
    assert main(["atts", "--alpha", "1.5", "--questions", "1"]) == 2  # the CLI: one line, status 2
    assert "tailspec: error: alpha must be in (0, 1), got 1.5" in capsys.readouterr().err


def test_the_deep_target_is_measured_compute_bound_and_memory_bound():
    from tailspec.benchmarks.atts import _reading
    from tailspec.benchmarks.run import _atts_bench_configs, atts_plot_name, atts_title

    with pytest.raises(ValueError, match="max_num_seqs"):
        ATTSBenchConfig(max_num_seqs=0)
    (tiny,) = _atts_bench_configs(quick=True)
    full, few = _atts_bench_configs(quick=True, policy="deep")
    assert (tiny.max_num_seqs, full.max_num_seqs, few.max_num_seqs) == (256, 256, 4)
    titles = [atts_title(c) for c in (tiny, full, few)]
    assert len(set(titles)) == 3 and titles[2].endswith("deep policy, at most 4 sequences per engine")
    assert [atts_plot_name(c) for c in (tiny, full, few)] == [
        "bench_atts.png",
        "bench_atts_deep.png",
        "bench_atts_deep_4seqs.png",
    ]
    assert "compute-bound" in _reading(full) and "memory-bound" in _reading(few)
