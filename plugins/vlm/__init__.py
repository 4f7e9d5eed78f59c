"""The vlm plugin (see docs/plugins.md)."""
