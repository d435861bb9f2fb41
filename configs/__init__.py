"""tailspec.configs: the shipped YAML and DeepSpeed configs (package data, in the wheel too)."""

from pathlib import Path


def configs_dir() -> Path:
    """The folder of the shipped configs."""
    return Path(__file__).resolve().parent
