"""A part of tailspec whose extra is not installed says so in one line: which extra to install."""

import importlib
import sys

import pytest

from tailspec.extras import EXTRAS, MissingExtra, need


@pytest.fixture
def hidden(monkeypatch):
    """Hide installed packages: importing them raises ImportError as if they were not installed."""

    def hide(*names: str) -> None:
        for name in names:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                monkeypatch.delitem(sys.modules, loaded)
            monkeypatch.setitem(sys.modules, name, None)

    return hide


def test_a_missing_extra_is_one_line_naming_it(hidden):
    hidden("ray")
    with pytest.raises(MissingExtra) as missing:
        need("ray", "ray", "rollout workers")
    assert str(missing.value) == "rollout workers needs ray, which is not installed: pip install 'tailspec[ray]'"
    with pytest.raises(ValueError, match="extra must be one of"):
        need("ray", "no-such-extra", "x")


def test_grpo_trainer_without_trl_names_the_trl_extra(hidden, monkeypatch):
    hidden("trl")
    monkeypatch.delitem(sys.modules, "tailspec.trainer_hooks.grpo_trainer", raising=False)
    with pytest.raises(MissingExtra, match=r"tailspec\.GRPOTrainer needs trl.*pip install 'tailspec\[trl\]'"):
        importlib.import_module("tailspec.trainer_hooks.grpo_trainer")


def test_ray_actors_without_ray_name_the_ray_extra(hidden):
    from tailspec.actors import RayActors

    hidden("ray")
    with pytest.raises(MissingExtra, match=r"pip install 'tailspec\[ray\]'"):
        RayActors().put(1)


def test_the_cli_says_so_in_one_line(hidden, capsys, monkeypatch):
    from tailspec.cli import main

    monkeypatch.delenv("TAILSPEC_DEBUG", raising=False)
    hidden("trl")
    assert main(["demo", "--no-wandb", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "tailspec: error: tailspec demo needs trl, which is not installed: pip install 'tailspec[trl]'"


def test_every_extra_is_declared_in_the_package_metadata():
    import importlib.metadata as md
    import re

    declared: dict[str, set[str]] = {}
    for requirement in md.requires("tailspec") or []:
        extra = re.search(r"extra == .(\w+).", requirement)
        if extra:
            declared.setdefault(extra.group(1), set()).add(re.split(r"[\[<>=~; ]", requirement)[0])
    for extra, packages in EXTRAS.items():
        assert set(packages) <= declared.get(extra, set()), (extra, declared.get(extra))
