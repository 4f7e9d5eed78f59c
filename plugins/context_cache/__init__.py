"""The context_cache plugin (see docs/plugins.md)."""
