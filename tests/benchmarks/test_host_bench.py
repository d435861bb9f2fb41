"""The host section: ModelRunner.padded_inputs timed per shape and attention path, written in place."""

import os

from tailspec.benchmarks.host import HOST_TITLE, SHAPES, run_host_section


def test_host_section_times_every_shape_on_both_paths(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    interpreter = os.environ.get("TRITON_INTERPRET")
    table = run_host_section(out, quick=True)
    assert os.environ.get("TRITON_INTERPRET") == interpreter  # set only while the section ran
    rows = [line for line in table.splitlines()[2:]]
    assert len(rows) == len(SHAPES)
    for row, (batch, context, new) in zip(rows, SHAPES):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:3] == [str(batch), str(context), str(new)]
        assert float(cells[3]) > 0 and float(cells[5]) > 0  # both paths (Triton is installed for the tests)
    text = out.read_text()
    assert f"## {HOST_TITLE}" in text and "tailspec bench --section host" in text
