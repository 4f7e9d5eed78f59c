"""The context cache plugin: prefix KV reuse under in-flight batching (``--enable-context-reuse``)."""

from __future__ import annotations

from ifb import hookimpl


@hookimpl
def ifb_prefix_cache(config, blocks, runtime, counters):
    if not config.enable_context_reuse:
        return None
    from ifb_plugins.context_cache.cache import PrefixCache

    return PrefixCache(blocks, counters)
