"""Choosing tokens from logits: per-sequence sampling and guided decoding."""
