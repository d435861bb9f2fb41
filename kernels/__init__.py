"""tailspec.kernels."""
