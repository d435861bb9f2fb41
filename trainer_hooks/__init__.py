"""tailspec.trainer_hooks."""
