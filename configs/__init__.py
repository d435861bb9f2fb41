"""tailspec.configs."""
