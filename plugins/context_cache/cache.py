"""Prefix KV reuse: full blocks keyed by a hash chain of their tokens.

A block's key is the hash of (the previous block's key, its token ids, the
request's KV salt), so a key names a whole prefix, and anything that changes
the KV for the same tokens (a LoRA adapter, media) changes the salt; the blocks
that lie wholly before a prompt's first media item are keyed without it
(``Request.num_unsalted_tokens``: their KV does not depend on the media), so
prompts that share a system prompt share its blocks whatever media follow. A block is
published only when the step that computed it has finished (``commit``), so a
request admitted into that same step can never lease half-written KV. Blocks
whose count drops to zero stay cached and are evicted least recently used,
except those a request pinned (``Request.num_pinned_tokens``: the legacy
system-prompt capture), which the cache holds a reference to for good.

Sliding-window KV groups (``BlockManager.window_groups``) publish their blocks
under the same keys, each group in a table of its own (``WindowBlocks``): a key
names a prefix, so every layer's KV for it is that prefix's. A window group
frees a block once no future query of its request can see it, and then the
block is evictable like any other, so a group may have lost blocks the full
pool still holds. A hit is therefore the longest prefix whose full blocks are
all cached and whose last ``window`` positions are cached in every window
group; the hit's window tables lease just those blocks (the entries before are
freed ones, as they would be had the request computed the prefix itself).
"""

from __future__ import annotations

import collections
import hashlib

import attrs

from ifb.counters import SchedulingCounters
from ifb.kv import BlockManager, WindowGroup
from ifb.request import Request
from ifb.runtime import ScheduledStep


def kv_salt(request: Request) -> bytes:
    """What besides the token ids changes a request's KV (its runtime's ``Prepared.kv_salt``: media, an adapter)."""
    return (request.kv_salt or "").encode()


def chain_hash(parent: bytes, token_ids: tuple[int, ...], salt: bytes) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(salt)
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return digest.digest()


@attrs.define
class _Tracked:
    """Per running request: keys of its full blocks computed so far."""

    salt: bytes
    keys: list[bytes] = attrs.field(factory=list)
    #: the leading blocks keyed without the salt (they lie before the request's first media item)
    num_unsalted_blocks: int = 0

    def salt_of(self, block: int) -> bytes:
        """The salt block ``block`` of the request's sequence is keyed with."""
        return b"" if block < self.num_unsalted_blocks else self.salt


class WindowBlocks:
    """One window group's published blocks (key <-> block id); its pool's ``ifb.kv.BlockCache``."""

    def __init__(self, group: WindowGroup):
        self.group = group
        self.table: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.pinned: set[bytes] = set()
        group.blocks.cache = self

    def keep(self, block_id: int) -> bool:
        if block_id not in self.key_of:
            return False
        self.evictable[block_id] = None
        return True

    def take(self, block_id: int) -> None:
        self.evictable.pop(block_id, None)

    def num_evictable(self) -> int:
        return len(self.evictable)

    def evict(self) -> int:
        block_id, _ = self.evictable.popitem(last=False)
        del self.table[self.key_of.pop(block_id)]
        return block_id

    def holds_window(self, keys: list[bytes], num_blocks: int) -> bool:
        """Whether the blocks a query right after the first ``num_blocks`` of ``keys`` sees are all here."""
        first = self.group.num_out_of_window(num_blocks * self.group.blocks.block_size)
        return all(key in self.table for key in keys[first:num_blocks])

    def publish(self, key: bytes, block_id: int) -> None:
        if key not in self.table and block_id not in self.key_of:
            self.table[key] = block_id
            self.key_of[block_id] = key

    def pin(self, key: bytes) -> None:
        if key not in self.pinned and key in self.table:
            self.pinned.add(key)
            self.group.blocks.incref([self.table[key]])


class PrefixCache:
    """Implements both ``ifb.kv.BlockCache`` and ``ifb.scheduler.PrefixMatcher``."""

    def __init__(self, blocks: BlockManager, counters: SchedulingCounters | None = None):
        self.blocks = blocks
        self.counters = counters or SchedulingCounters()
        self.table: dict[bytes, int] = {}  # key -> block id (published blocks)
        self.key_of: dict[int, bytes] = {}  # block id -> key
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._tracked: dict[str, _Tracked] = {}
        #: keys of the blocks pinned by a capture (the cache holds one reference to each)
        self.pinned: set[bytes] = set()
        blocks.cache = self
        #: the sliding-window groups' published blocks, one table each
        self.windows = tuple(WindowBlocks(group) for group in blocks.window_groups)

    # ---- BlockCache ----
    def keep(self, block_id: int) -> bool:
        if block_id not in self.key_of:
            return False
        self.evictable[block_id] = None  # most recently used at the end
        return True

    def take(self, block_id: int) -> None:
        self.evictable.pop(block_id, None)

    def num_evictable(self) -> int:
        return len(self.evictable)

    def evict(self) -> int:
        block_id, _ = self.evictable.popitem(last=False)
        del self.table[self.key_of.pop(block_id)]
        with self.counters.lock:
            self.counters.prefix_cache_evictions += 1
        return block_id

    # ---- PrefixMatcher ----
    def match(self, request: Request) -> tuple[list[int], int]:
        """Lease the longest published prefix of the request's tokens, leaving at least one to compute.

        A request coming back from preemption matches its generated tokens too:
        the blocks it published before it left are reused rather than recomputed.
        """
        size = self.blocks.block_size
        tracked = _Tracked(kv_salt(request), num_unsalted_blocks=request.num_unsalted_tokens // size)
        self._tracked[request.request_id] = tracked
        prompt = request.all_token_ids()
        leased: list[int] = []
        parent = b""
        for i in range((len(prompt) - 1) // size):
            key = chain_hash(parent, tuple(prompt[i * size:(i + 1) * size]), tracked.salt_of(i))
            block_id = self.table.get(key)
            if block_id is None:
                break
            leased.append(block_id)
            tracked.keys.append(key)
            parent = key
        num = len(leased)
        while num and not all(window.holds_window(tracked.keys, num) for window in self.windows):
            num -= 1  # a window group no longer holds what a query there would see
        del leased[num:], tracked.keys[num:]
        self.blocks.incref(leased)
        for window, table in zip(self.windows, request.window_tables):
            table.num_freed = window.group.num_out_of_window(num * size)
            table.block_ids = [window.table[key] for key in tracked.keys[table.num_freed:]]
            window.group.blocks.incref(table.block_ids)
        with self.counters.lock:
            self.counters.prefix_cache_queries += len(prompt)
            self.counters.prefix_cache_hits += len(leased) * size
        return leased, len(leased) * size

    def commit(self, step: ScheduledStep, requests: dict[str, Request]) -> None:
        """The step finished: publish every block it filled (first writer wins)."""
        size = self.blocks.block_size
        for seq in step.seqs:
            tracked = self._tracked.get(seq.request_id)
            request = requests.get(seq.request_id)
            if tracked is None or request is None:
                continue
            num_full = (seq.start_pos + len(seq.token_ids)) // size
            tokens = request.all_token_ids()
            for i in range(len(tracked.keys), num_full):
                parent = tracked.keys[-1] if tracked.keys else b""
                key = chain_hash(parent, tuple(tokens[i * size:(i + 1) * size]), tracked.salt_of(i))
                tracked.keys.append(key)
                block_id = request.block_ids[i]
                if key not in self.table and block_id not in self.key_of:
                    self.table[key] = block_id
                    self.key_of[block_id] = key
                for window, table in zip(self.windows, request.window_tables):
                    if i >= table.num_freed:  # a block this step computed is still in its table
                        window.publish(key, table.block_ids[i - table.num_freed])
            self._pin(request, tracked)

    def _pin(self, request: Request, tracked: _Tracked) -> None:
        """Hold the full blocks of the request's pinned prefix that are published (a capture)."""
        for key in tracked.keys[:request.num_pinned_tokens // self.blocks.block_size]:
            if key not in self.pinned and key in self.table:
                self.pinned.add(key)
                self.blocks.incref([self.table[key]])
            for window in self.windows:
                window.pin(key)

    def forget(self, request: Request) -> None:
        self._tracked.pop(request.request_id, None)

    def stats(self) -> dict[str, int]:
        out = {"cached_blocks": len(self.key_of), "evictable_blocks": len(self.evictable)}
        for i, window in enumerate(self.windows):
            out[f"window_group_{i}_cached_blocks"] = len(window.key_of)
        return out
