"""tailspec.drafter."""
