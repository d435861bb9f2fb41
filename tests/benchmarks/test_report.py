from tailspec.benchmarks.report import replace_section


def test_replace_section_rewrites_one_section_in_place(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## A\n\nold a\n\n## B\n\nold b\n")
    replace_section(out, "A", "new a", "tailspec bench --section a")
    text = out.read_text()
    assert "old a" not in text and "new a\n\n## B\n\nold b\n" in text  # a blank line before the next section
    assert "Measured by `tailspec bench --section a`" in text
    replace_section(out, "C", "new c", "cmd")
    text = out.read_text()
    assert text.rstrip().endswith("new c") and text.index("## C") > text.index("## B")  # appended
