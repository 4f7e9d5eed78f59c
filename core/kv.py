"""Paged KV bookkeeping: fixed-size blocks, reference counts, an optional block cache.

The engine owns the numbers; the runtime owns the tensors. A block is free
when its count is zero and no cache keeps it. A ``BlockCache`` (the context
cache plugin) may keep released blocks for reuse and give them up, least
recently used first, when room is needed.

KV cache groups (as vLLM's hybrid KV cache manager has them): a runtime whose
sliding-window layers read only the last ``window`` positions before each
query declares them as a ``WindowGroupSpec``. The ``BlockManager`` is then the
pool of the full-attention layers (``Request.block_ids``) and each window group
has a pool of its own (``BlockManager.window_groups``) and, per request, a
``WindowTable`` with one logical entry per block of the context, like the full
table: the two always have the same length, so a step needs the same number of
new blocks in every group, but a window group frees each block as soon as it
lies wholly before every future query's window, so a sequence holds at most
``WindowGroup.max_blocks_per_seq`` of its blocks there, whatever its length.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from ifb.request import Request
    from ifb.runtime import ScheduledStep


class BlockCache(Protocol):
    def keep(self, block_id: int) -> bool:
        """A block's count reached zero: return True to keep it (evictable) instead of freeing."""

    def take(self, block_id: int) -> None:
        """A kept block is referenced again: it is no longer evictable."""

    def num_evictable(self) -> int: ...

    def evict(self) -> int:
        """Forget the least recently used kept block and hand it back for reuse."""


class PrefixMatcher(Protocol):
    """Finds published KV blocks a new request can lease (the context cache plugin)."""

    def match(self, request: Request) -> tuple[list[int], int]:
        """Return (block_ids already leased for the request, number of tokens they hold).

        Where the pool has sliding-window groups (``BlockManager.window_groups``) a matcher that knows
        them also leases, into each of ``request.window_tables``, the blocks still resident there that the
        hit's next query can see, so the hit is one that every group holds; the scheduler drops a hit
        whose window tables were not filled.
        """

    def commit(self, step: ScheduledStep, requests: dict[str, Request]) -> None:
        """The step finished: publish the full blocks it computed."""

    def forget(self, request: Request) -> None:
        """The request left its seat; drop any per-request bookkeeping."""


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    """The blocks of one KV cache group; the full-attention group's manager also holds the window groups."""

    def __init__(self, num_blocks: int, block_size: int, cache: BlockCache | None = None,
                 window_groups: tuple[WindowGroup, ...] = ()):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        #: the sliding-window groups' pools, beside this one (the full-attention layers')
        self.window_groups = window_groups
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        #: the most blocks held at once (referenced; a cache's evictable ones count as free)
        self.max_num_in_use = 0

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
        self.max_num_in_use = max(self.max_num_in_use, self.num_in_use)
        return out

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> dict[str, int]:
        """The pool's counters: its size, the blocks held now and the most held at once."""
        return {"num_blocks": self.num_blocks, "blocks_in_use": self.num_in_use,
                "max_blocks_in_use": self.max_num_in_use}

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

    @property
    def num_free_in_every_group(self) -> int:
        """Blocks every group can hand out now (a step takes as many new blocks in each)."""
        return min([self.num_free, *(g.blocks.num_free for g in self.window_groups)])

    def can_allocate_in_every_group(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_in_every_group

    def can_admit(self, num_blocks: int, num_first_tokens: int, reserve: int, num_residents: int,
                  whole: bool = False) -> bool:
        """Whether a request whose prefill needs ``num_blocks`` here fits with ``reserve`` blocks left free.

        A window group needs only the window of the first ``num_first_tokens`` (``whole``: all of it), and
        keeps a reserve of its own size's watermark (1 %, at least one) and a block per resident, at most
        ``reserve``: its pool is sized for the seats, not the contexts."""
        def fits(group: WindowGroup) -> bool:
            need = num_blocks if whole else min(num_blocks, group.max_blocks_per_seq(num_first_tokens))
            own_reserve = min(reserve, max(1, group.blocks.num_blocks // 100) + num_residents)
            return group.blocks.can_allocate(need + own_reserve)

        return self.can_allocate(num_blocks + reserve) and all(fits(g) for g in self.window_groups)

    def grow_all(self, block_ids: list[int], tables: list[WindowTable], num_blocks: int) -> None:
        """Append ``num_blocks`` to a request's table in every group (the same entries in each)."""
        block_ids += self.allocate(num_blocks)
        for group, table in zip(self.window_groups, tables):
            group.grow(table, num_blocks)

    def free_all(self, block_ids: list[int], tables: list[WindowTable]) -> None:
        """Free a request's blocks in every group."""
        self.free(block_ids)
        for group, table in zip(self.window_groups, tables):
            group.release(table)

    def slide(self, tables: list[WindowTable], next_position: int) -> None:
        """Free what no query from ``next_position`` on sees in each of a request's window tables."""
        for group, table in zip(self.window_groups, tables):
            group.slide(table, next_position)

    def drop_window_tails(self, tables: list[WindowTable], num_entries: int) -> None:
        for group, table in zip(self.window_groups, tables):
            group.drop_tail(table, num_entries)

    def window_changes(self, tables: list[WindowTable]) -> list[tuple[int, tuple[int, ...]]]:
        """Per window table, its freed entries and the blocks the runtime has not been sent (now marked sent)."""
        return [(table.num_freed, group.unsent(table)) for group, table in zip(self.window_groups, tables)]

    def check_no_leaks(self) -> None:
        """Every count is zero and every block is free or kept by the cache (in every group)."""
        held = [b for b, c in enumerate(self.ref_counts) if c]
        if held:
            raise AssertionError(f"blocks still referenced: {held[:10]}")
        if self.num_free != self.num_blocks:
            raise AssertionError(f"{self.num_free} of {self.num_blocks} blocks free")
        for group in self.window_groups:
            group.blocks.check_no_leaks()


@attrs.frozen
class WindowGroupSpec:
    """A runtime's sliding-window KV group: layers whose query at position ``p`` reads only positions
    ``p - window + 1 .. p``, over ``num_blocks`` blocks of their own (``Runtime.kv_window_groups``)."""

    window: int
    num_blocks: int


@attrs.define
class WindowTable:
    """A request's block table in one window group.

    Logically one entry per block of the context, as many as the full table's;
    the leading ``num_freed`` entries are freed (out of every future query's
    window), ``block_ids`` hold the rest.
    """

    block_ids: list[int] = attrs.field(factory=list)
    num_freed: int = 0
    #: logical entries the runtime has been told of (the rest go with the request's next step)
    num_sent: int = 0

    @property
    def num_entries(self) -> int:
        return self.num_freed + len(self.block_ids)


class WindowGroup:
    """A window group's pool and what it does to a request's ``WindowTable``."""

    def __init__(self, window: int, blocks: BlockManager):
        if window < 1:
            raise ValueError("a sliding window covers at least the query's own position")
        self.window = window
        self.blocks = blocks

    @classmethod
    def from_spec(cls, spec: WindowGroupSpec, block_size: int) -> WindowGroup:
        return cls(spec.window, BlockManager(spec.num_blocks, block_size))

    def num_out_of_window(self, next_position: int) -> int:
        """Leading blocks wholly before the window of a query at ``next_position`` (and every later one)."""
        return max(0, next_position - self.window + 1) // self.blocks.block_size

    def max_blocks_per_seq(self, num_new_tokens: int) -> int:
        """The most blocks a sequence holds here while it computes ``num_new_tokens`` at once."""
        return -(-(self.window - 1 + num_new_tokens) // self.blocks.block_size) + 1

    def slide(self, table: WindowTable, next_position: int) -> None:
        """Free the table's blocks that no query from ``next_position`` on can see; they return to the pool."""
        num = self.num_out_of_window(next_position) - table.num_freed
        if num > 0:
            self.blocks.free(table.block_ids[:num])
            del table.block_ids[:num]
            table.num_freed += num

    def grow(self, table: WindowTable, num_blocks: int) -> None:
        table.block_ids += self.blocks.allocate(num_blocks)

    def lease(self, table: WindowTable, source: WindowTable, num_entries: int) -> None:
        """``table`` shares ``source``'s first ``num_entries`` entries (an n > 1 sequence forking)."""
        table.num_freed = min(source.num_freed, num_entries)
        table.block_ids = source.block_ids[:num_entries - table.num_freed]
        self.blocks.incref(table.block_ids)

    def drop_tail(self, table: WindowTable, num_entries: int) -> None:
        """Free the entries past the first ``num_entries`` (blocks only rejected drafts had used)."""
        keep = max(0, num_entries - table.num_freed)
        self.blocks.free(table.block_ids[keep:])
        del table.block_ids[keep:]
        table.num_sent = min(table.num_sent, num_entries)

    def release(self, table: WindowTable) -> None:
        self.blocks.free(table.block_ids)
        table.block_ids, table.num_freed, table.num_sent = [], 0, 0

    def unsent(self, table: WindowTable) -> tuple[int, ...]:
        """The entries appended since the runtime last heard of the table (now marked sent); they all
        follow the freed ones, or come after a lease whose freed entries the runtime reads as freed."""
        new = tuple(table.block_ids[max(0, table.num_sent - table.num_freed):])
        table.num_sent = table.num_entries
        return new


def pool_for(runtime) -> BlockManager:
    """The engine's block bookkeeping for ``runtime``: its full-attention pool and its window groups'
    (``kv_window_groups``, where it declares any)."""
    groups = tuple(WindowGroup.from_spec(spec, runtime.kv_block_size)
                   for spec in getattr(runtime, "kv_window_groups", ()))
    return BlockManager(runtime.num_kv_blocks, runtime.kv_block_size, window_groups=groups)
