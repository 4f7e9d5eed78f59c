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
"""

from __future__ import annotations

import collections
import hashlib

import attrs

from ifb.counters import SchedulingCounters
from ifb.kv import BlockManager
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
        self.blocks.incref(leased)
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
            self._pin(request, tracked)

    def _pin(self, request: Request, tracked: _Tracked) -> None:
        """Hold the full blocks of the request's pinned prefix that are published (a capture)."""
        for key in tracked.keys[:request.num_pinned_tokens // self.blocks.block_size]:
            if key not in self.pinned and key in self.table:
                self.pinned.add(key)
                self.blocks.incref([self.table[key]])

    def forget(self, request: Request) -> None:
        self._tracked.pop(request.request_id, None)

    def stats(self) -> dict[str, int]:
        return {"cached_blocks": len(self.key_of), "evictable_blocks": len(self.evictable)}
