"""Tiny reference-built checkpoints and helpers the tests and benchmarks share."""
