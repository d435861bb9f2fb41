"""Which tailspec units a module imports (lazy imports inside functions included), read from its
source: the architecture test and the wheel test check imports with it."""

import ast


def imported_units(source: str, package: list[str]) -> set[str]:
    """The units (top-level modules or packages of tailspec, e.g. ``rollout``) that ``source``, a
    module of the package ``package`` (``["tailspec", "rollout"]``), imports."""
    return {t[0] for t in imported_modules(source, package)}


def imported_modules(source: str, package: list[str]) -> set[tuple[str, ...]]:
    """What ``source`` imports from tailspec, as dotted paths under it (``("rollout", "model",
    "runner")``; for ``from .x import name`` the path ends with ``x``, or with ``name`` when it
    imports from a package's face)."""
    targets = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            if node.module:
                targets.append([*base, *node.module.split(".")])
            else:
                targets += [[*base, alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tailspec."):
            targets.append(node.module.split("."))
        elif isinstance(node, ast.Import):
            targets += [alias.name.split(".") for alias in node.names if alias.name.startswith("tailspec.")]
    return {tuple(t[1:]) for t in targets if len(t) > 1}
