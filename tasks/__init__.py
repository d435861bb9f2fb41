"""Synthetic reasoning tasks, a local tokenizer and the SFT recipe for the shipped tiny models."""
