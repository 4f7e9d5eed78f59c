"""The speech plugin (see docs/plugins.md)."""
