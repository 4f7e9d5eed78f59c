"""The mamba plugin (see docs/plugins.md)."""
