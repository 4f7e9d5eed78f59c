"""The context cache plugin: prefix KV reuse under in-flight batching (``--enable-context-reuse``).

For a runtime with recurrent state (one that offers ``state_checkpoints``) the
cache also keeps state checkpoints beside the blocks (``hybrid``).
"""

from __future__ import annotations

from ifb import hookimpl


@hookimpl
def ifb_prefix_cache(config, blocks, runtime, counters):
    if not config.enable_context_reuse:
        return None
    store = getattr(runtime, "state_checkpoints", None)
    if store is not None:
        from ifb_plugins.context_cache.hybrid import HybridPrefixCache

        return HybridPrefixCache(blocks, store, counters)
    from ifb_plugins.context_cache.cache import PrefixCache

    return PrefixCache(blocks, counters)
