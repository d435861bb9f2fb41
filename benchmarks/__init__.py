"""Benchmarks behind ``make bench`` / ``tailspec bench``; each measures its baselines side by side."""
