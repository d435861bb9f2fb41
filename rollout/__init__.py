"""tailspec.rollout."""
