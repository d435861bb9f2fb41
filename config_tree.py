"""One way to build, override and validate tailspec's configuration dataclasses.

A configuration is a tree of dataclasses: ``SpecRolloutConfig`` holds the engine's
``RolloutConfig`` (which holds a ``SelectorConfig`` and a ``MirrorConfig``), the workers'
``WorkersConfig`` and the online-training settings; the demo's config holds a
``SpecRolloutConfig``. A field whose declared type is a dataclass is a *subtree*; it takes an
instance or a dict of its fields, and a dict is laid over the field's default (so
``workers: {spot_training: false}`` keeps the rest of that default).

Every error is a :class:`ConfigError` that names the field by its dotted path from the root
(``engine.selector.calibration_rows must be an int >= 1, got 0``), whether the value came from
Python, YAML or ``--set engine.selector.calibration_rows=0``. Nodes validate themselves in ``__post_init__`` with
:func:`require`, and call :func:`coerce_subtrees` to turn their dict-valued subtrees into nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

__all__ = [
    "ConfigError",
    "apply_overrides",
    "build",
    "coerce_subtrees",
    "field_paths",
    "int_at_least",
    "is_int",
    "parse_assignments",
    "require",
]


class ConfigError(ValueError):
    """A configuration value that is not allowed: ``path`` (dotted from the root) ``problem``."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"{path} {problem}" if path else problem)

    def under(self, prefix: str) -> ConfigError:
        """The same error seen from ``prefix``'s parent."""
        return ConfigError(f"{prefix}.{self.path}" if self.path else prefix, self.problem)


def is_int(value: Any) -> bool:
    """An int and not a bool (``True`` is an int to Python, not to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(value: Any, low: int) -> bool:
    return is_int(value) and value >= low


def number_at_least(value: Any, low: float) -> bool:
    """An int or a float (not a bool) at least ``low``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low


def require(ok: bool, name: str, allowed: str, value: Any) -> None:
    """Raise ``ConfigError`` "``name`` must be ``allowed``, got ``value``" unless ``ok``."""
    if not ok:
        raise ConfigError(name, f"must be {allowed}, got {value!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[Any, ...]]:
    """Each init field's declared types: ``(X,)``, or the members of ``X | Y``."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        out[f.name] = typing.get_args(hint) if union else (hint,)
    return out


@functools.cache
def _subtree_types(cls: type) -> dict[str, type]:
    """The fields of ``cls`` whose declared type is a dataclass (``X`` or ``X | None``)."""
    found = {}
    for name, options in _field_types(cls).items():
        nodes = [t for t in options if dataclasses.is_dataclass(t)]
        if nodes:
            found[name] = nodes[0]
    return found


def _default_of(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


#: fields a config once had, with why they went: a config that still names one is told that
RETIRED_FIELDS = {
    ("RolloutConfig", "overlap"): "is gone: every decode step is launched before the one before it is committed",
}


def _check_keys(cls: type, data: Mapping[str, Any], path: str) -> None:
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            if (cls.__name__, key) in RETIRED_FIELDS:
                raise ConfigError(where, RETIRED_FIELDS[(cls.__name__, key)])
            raise ConfigError(where, f"is not a field of {cls.__name__}; its fields: {', '.join(known)}")


def _float_fields(cls: type) -> frozenset[str]:
    return frozenset(name for name, options in _field_types(cls).items() if float in options)


def _floats_read_as_strings(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """YAML 1.1 reads ``1e-6`` as a string: a float field takes the number such a string spells."""
    out = dict(data)
    for name in _float_fields(cls) & out.keys():
        value = out[name]
        if isinstance(value, str):
            try:
                out[name] = float(value)
            except ValueError:
                pass  # refused by the node's own check, naming the field
    return out


def build(cls: type, data: Mapping[str, Any], *, base: Any = None, path: str = "") -> Any:
    """``cls`` from a dict of its fields (nested dicts for subtrees), laid over ``base`` when one is
    given; unknown keys and bad values raise :class:`ConfigError` with their dotted path."""
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"must be a {cls.__name__} or a mapping of its fields, got {data!r}")
    _check_keys(cls, data, path)
    data = _floats_read_as_strings(cls, data)
    try:
        return dataclasses.replace(base, **data) if base is not None else cls(**data)
    except ConfigError as e:
        raise e.under(path) if path else e from None


def coerce_subtrees(node: Any) -> None:
    """In ``node.__post_init__``: each subtree field given as a dict becomes its dataclass, laid over
    the field's default; anything else than None or the dataclass is refused."""
    cls = type(node)
    for name, sub in _subtree_types(cls).items():
        value = getattr(node, name)
        if isinstance(value, Mapping):
            default = _default_of(cls, name)
            value = build(sub, value, base=default if isinstance(default, sub) else None, path=name)
            object.__setattr__(node, name, value)  # frozen nodes too
        require(value is None or isinstance(value, sub), name, f"None, a {sub.__name__} or a dict of its fields", value)


def field_paths(cls: type, prefix: str = "") -> dict[str, list[str]]:
    """Every field's dotted path in the tree under ``cls``, grouped by the field's own name."""
    paths: dict[str, list[str]] = {}
    subtrees = _subtree_types(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}{f.name}"
        paths.setdefault(f.name, []).append(path)
        if f.name in subtrees:
            for name, below in field_paths(subtrees[f.name], f"{path}.").items():
                paths.setdefault(name, []).extend(below)
    return paths


def resolve_name(cls: type, name: str) -> str:
    """The dotted path a key names: a dotted path as it is; a field of ``cls`` itself; else the
    one field of that name anywhere below (an error lists the paths when several share it)."""
    if "." in name:
        return name
    paths = field_paths(cls).get(name, [])
    if name in paths:
        return name
    if len(paths) == 1:
        return paths[0]
    if not paths:
        raise ConfigError(name, f"is not a field of {cls.__name__} or of any config below it")
    raise ConfigError(name, f"names several fields; give one of the dotted paths {', '.join(paths)}")


def apply_overrides(node: Any, overrides: Mapping[str, Any]) -> Any:
    """A copy of ``node`` with ``overrides`` set: each key a dotted path (``engine.strategy``), or a
    field's own name where only one field in the tree has it (``strategy``). Validated as a whole."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = resolve_name(type(node), key).split(".")
        at = nested
        for part in parts[:-1]:
            at = at.setdefault(part, {})
            if not isinstance(at, dict):
                raise ConfigError(key, "is set twice: as a whole and field by field")
        at[parts[-1]] = value
    return _lay_over(node, nested, "")


def _lay_over(node: Any, nested: Mapping[str, Any], path: str) -> Any:
    cls = type(node)
    _check_keys(cls, nested, path)
    subtrees = _subtree_types(cls)
    changes = {}
    for key, value in nested.items():
        current = getattr(node, key)
        if key in subtrees and isinstance(value, Mapping) and not isinstance(current, Mapping):
            where = f"{path}.{key}" if path else key
            sub_base = current if current is not None else _default_of(cls, key)
            value = (
                _lay_over(sub_base, value, where) if sub_base is not None else build(subtrees[key], value, path=where)
            )
        changes[key] = value
    return build(cls, changes, base=node, path=path)


def parse_assignments(assignments: Iterable[str]) -> dict[str, Any]:
    """``["engine.strategy=chain:4", "workers.num_workers=2"]`` -> ``{dotted path: value}``, each
    value read as YAML (``2`` an int, ``null`` None, ``[a, b]`` a list, ``chain:4`` a string)."""
    out: dict[str, Any] = {}
    for text in assignments:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", f"takes KEY=VALUE (a dotted path, e.g. engine.strategy=chain:4), got {text!r}")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out
