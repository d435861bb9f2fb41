"""config_tree: dicts laid over defaults, dotted paths, names resolved where unique, errors that
name the field's dotted path, --set assignments read as YAML."""

from dataclasses import dataclass, field

import pytest

from tailspec.config_tree import (
    ConfigError,
    apply_overrides,
    build,
    coerce_subtrees,
    field_paths,
    parse_assignments,
    require,
)


@dataclass
class Leaf:
    size: int = 1
    rate: float = 0.5

    def __post_init__(self) -> None:
        require(isinstance(self.size, int) and self.size >= 1, "size", "an int >= 1", self.size)


@dataclass
class Branch:
    leaf: Leaf = field(default_factory=lambda: Leaf(size=4))
    spare: Leaf | None = None
    name: str = "b"

    def __post_init__(self) -> None:
        coerce_subtrees(self)


@dataclass
class Root:
    branch: Branch = field(default_factory=Branch)
    size: int = 7  # the same name as Leaf.size: the root's own field wins when named alone

    def __post_init__(self) -> None:
        coerce_subtrees(self)


def test_a_dict_is_laid_over_the_fields_default_not_the_classes():
    root = build(Root, {"branch": {"leaf": {"rate": 0.25}}})
    assert root.branch.leaf == Leaf(size=4, rate=0.25)  # size kept from Branch's default leaf, not Leaf's 1
    assert root.branch.spare is None and build(Root, {"branch": {"spare": {}}}).branch.spare == Leaf()


def test_errors_name_the_dotted_path_from_python_yaml_and_overrides():
    with pytest.raises(ConfigError, match=r"^branch\.leaf\.size must be an int >= 1, got 0$"):
        build(Root, {"branch": {"leaf": {"size": 0}}})
    with pytest.raises(ConfigError, match=r"^branch\.leaf\.size must be"):
        apply_overrides(Root(), {"branch.leaf.size": 0})
    with pytest.raises(ConfigError, match=r"^branch\.leaf\.colour is not a field of Leaf; its fields: size, rate$"):
        build(Root, {"branch": {"leaf": {"colour": 1}}})
    with pytest.raises(ConfigError, match=r"^branch\.spare must be None, a Leaf or a dict of its fields, got 3$"):
        build(Root, {"branch": {"spare": 3}})


def test_overrides_take_dotted_paths_or_names_only_one_field_has():
    root = apply_overrides(Root(), {"branch.leaf.rate": 0.1, "branch.spare.size": 2, "name": "x"})
    assert (root.branch.leaf.rate, root.branch.spare, root.branch.name) == (0.1, Leaf(size=2), "x")
    assert apply_overrides(Root(), {"size": 9}).size == 9  # the root's own field
    with pytest.raises(ConfigError, match="^rate names several fields; give one of the dotted paths branch.leaf.rate"):
        apply_overrides(Root(), {"rate": 0.1})
    with pytest.raises(ConfigError, match="is not a field of Root or of any config below it"):
        apply_overrides(Root(), {"colour": 2})
    assert field_paths(Root)["rate"] == ["branch.leaf.rate", "branch.spare.rate"]
    before = Root()
    apply_overrides(before, {"branch.leaf.size": 3})
    assert before.branch.leaf.size == 4  # a copy: the original is untouched


def test_assignments_are_read_as_yaml():
    got = parse_assignments(["a.b=2", "c=null", "d=[x, 'chain:4']", "e=chain:4", "f=1e-6", "g="])
    assert got == {"a.b": 2, "c": None, "d": ["x", "chain:4"], "e": "chain:4", "f": "1e-6", "g": None}
    assert build(Leaf, {"rate": got["f"]}).rate == 1e-6  # YAML 1.1 reads 1e-6 as a string; a float field takes it
    with pytest.raises(ConfigError, match="takes KEY=VALUE"):
        parse_assignments(["no-equals-sign"])
