"""The benchmark registry: every section's function exists and takes what the CLI passes it."""

import inspect
from importlib import import_module

import pytest

from tailspec.benchmarks.sections import SECTIONS, Section, register
from tailspec.cli import build_parser


@pytest.mark.parametrize("name", list(SECTIONS))
def test_each_section_runs_a_function_that_takes_its_options(name):
    section = SECTIONS[name]
    module, function = section.function.split(":")
    run = getattr(import_module(f"tailspec.benchmarks.{module}"), function)
    params = inspect.signature(run).parameters
    assert next(iter(params)) == "out"
    assert set(section.options) | set(section.fixed) <= set(params), (name, set(params))
    args = build_parser().parse_args(["bench", "--section", name])
    assert all(hasattr(args, option) for option in section.options)


def test_the_cli_offers_every_section_and_a_name_registers_once():
    parser = build_parser()
    for name in SECTIONS:
        assert parser.parse_args(["bench", "--section", name]).section == name
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--section", "nope"])
    with pytest.raises(ValueError, match="twice"):
        register(Section("sweep", "run:run_sweep_section", (), "again"))


def test_make_bench_runs_every_section_with_each_of_its_bench_options(monkeypatch, tmp_path):
    from tailspec.benchmarks import sections

    ran = []

    def fake_run(self, out, args):
        ran.append((self.name, vars(args).copy()))
        return f"table of {self.name}"

    monkeypatch.setattr(Section, "run", fake_run)
    tables = sections.run_bench(tmp_path / "B.md", quick=True, threads=2)
    expected = [(s.name, options) for s in SECTIONS.values() for options in s.bench]
    assert [name for name, _ in ran] == [name for name, _ in expected]
    for (_, args), (_, options) in zip(ran, expected):
        assert {k: args[k] for k in options} == options
    assert all(args["quick"] is True and args["threads"] == 2 for _, args in ran)
    assert {name for name, _ in ran} == set(SECTIONS)  # make bench covers the whole report
    assert ("adaptive", {"policy": "deep", "drafter": "lm"}) in expected
    assert tables.count("table of sweep") == 2


def test_bench_defaults_are_the_clis():
    from tailspec.benchmarks.sections import BENCH_DEFAULTS

    args = build_parser().parse_args(["bench"])
    assert {name: getattr(args, name) for name in BENCH_DEFAULTS} == BENCH_DEFAULTS
    for section in SECTIONS.values():
        for options in section.bench:
            assert set(options) <= set(section.options), section.name
