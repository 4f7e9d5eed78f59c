"""Tokenizers and chat rendering with the checkpoint's template."""
