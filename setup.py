"""The wheel's packages, found in the tree rather than listed by hand.

The repository root is the package ``tailspec`` (``package-dir`` in pyproject.toml), so every
folder below it that holds an ``__init__.py`` is ``tailspec.<folder>``, except the folders the
checkout keeps for itself: the chain-sum task and its model recipes, the shipped weights and the
benchmark harness (which ``make demo`` and ``make bench`` run from the checkout), tests, examples
and docs. This file sits in the package's folder too, and is left out of it.
``tests/wheel_check.py`` installs the built wheel where the checkout is not and imports every module.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

CHECKOUT_ONLY = ("tasks", "assets", "benchmarks", "tests", "examples", "docs")


def library_packages() -> list[str]:
    """``tailspec`` and each package under it that the wheel ships."""
    found = find_packages(where=".", exclude=[p for name in CHECKOUT_ONLY for p in (name, f"{name}.*")])
    return ["tailspec", *(f"tailspec.{name}" for name in found)]


class BuildLibrary(build_py):
    """Every module of the packages but this file, which lies in ``tailspec``'s folder."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("tailspec", "setup")]


if __name__ == "__main__":
    setup(packages=library_packages(), cmdclass={"build_py": BuildLibrary})
