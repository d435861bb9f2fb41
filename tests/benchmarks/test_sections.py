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
