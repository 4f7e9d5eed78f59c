"""Prefix reuse for hybrid (recurrent-state) models: KV blocks plus state checkpoints beside them.

A recurrent model resumes a prefix only from the recurrent state at the end
of it, so a checkpoint is kept with the block that ends at its position (the
runtime captures it, this cache decides what to keep). A joiner leases the
blocks up to the deepest kept checkpoint its prompt matches, starts its seat
from that checkpoint and computes everything after it. Matching KV beyond
the last checkpoint is not leased: without the state at its end it cannot
be resumed. A hit is counted in tokens only when KV and state both come
from the cache.

Slots are few (they come out of the KV capacity): a checkpoint lives as long
as its block stays published (evicting the block frees the slot), and when a
new checkpoint needs a slot and none is free, the least recently used
checkpoint that no waiting joiner has pinned gives its slot up. A joiner pins
its slot from admission until its first step has run (the runtime copies the
state then).
"""

from __future__ import annotations

import collections
from typing import Protocol

from ifb.counters import SchedulingCounters
from ifb.kv import BlockManager
from ifb.request import Request
from ifb.runtime import ScheduledStep
from ifb_plugins.context_cache.cache import PrefixCache, _Tracked, chain_hash, kv_salt


class RecurrentStateCheckpoints(Protocol):
    """What a runtime with recurrent state offers the cache (``runtime.state_checkpoints``)."""

    #: state slots the runtime holds
    num_slots: int

    def has_capture(self, request_id: str, position: int) -> bool:
        """Whether the last step captured the request's state after ``position`` tokens."""

    def save(self, request_id: str, position: int, slot: int) -> bool:
        """Keep that captured state in ``slot``; False when the last step did not capture it."""

    def stage_restore(self, request_id: str, position: int, slot: int) -> None:
        """When the request first runs (from ``position``), its state starts from ``slot``."""

    def cancel_restore(self, request_id: str) -> None:
        """Drop a staged restore that will not run."""


class HybridPrefixCache(PrefixCache):
    """``PrefixCache`` that keeps and restores recurrent-state checkpoints with the blocks."""

    def __init__(self, blocks: BlockManager, store: RecurrentStateCheckpoints,
                 counters: SchedulingCounters | None = None):
        super().__init__(blocks, counters)
        self.store = store
        self.slot_of: dict[bytes, int] = {}  # block key -> slot of the checkpoint at that block's end
        self.key_of_slot: dict[int, bytes] = {}
        self.free_slots: list[int] = list(range(store.num_slots))
        self.slot_lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.pins: dict[int, int] = collections.Counter()  # slot -> joiners waiting to restore from it
        self.pin_of: dict[str, int] = {}  # request id -> its pinned slot
        self.state_evictions = 0

    # ---- BlockCache ----
    def evict(self) -> int:
        key = self.key_of[next(iter(self.evictable))]  # the block super() evicts: the least recently used
        block_id = super().evict()
        slot = self.slot_of.get(key)
        if slot is not None:  # the checkpoint goes with its block
            self._drop_checkpoint(slot)
        return block_id

    # ---- PrefixMatcher ----
    def match(self, request: Request) -> tuple[list[int], int]:
        """Lease the blocks up to the deepest kept checkpoint the prompt matches (leaving a token to compute)."""
        size = self.blocks.block_size
        if self._unpin(request.request_id):  # matched again (re-admitted) before its first step ran
            self.store.cancel_restore(request.request_id)
        tracked = _Tracked(kv_salt(request))
        self._tracked[request.request_id] = tracked
        prompt = request.all_token_ids()  # a request back from preemption brings its generated tokens too
        keys: list[bytes] = []
        depth = 0  # blocks up to the deepest checkpoint
        parent = b""
        for i in range((len(prompt) - 1) // size):
            key = chain_hash(parent, tuple(prompt[i * size:(i + 1) * size]), tracked.salt)
            if key not in self.table:
                break
            keys.append(key)
            if key in self.slot_of:
                depth = i + 1
            parent = key
        leased = [self.table[key] for key in keys[:depth]]
        tracked.keys = keys[:depth]
        self.blocks.incref(leased)
        if depth:
            slot = self.slot_of[keys[depth - 1]]
            self.slot_lru.move_to_end(slot)
            self.pins[slot] += 1
            self.pin_of[request.request_id] = slot
            self.store.stage_restore(request.request_id, depth * size, slot)
        with self.counters.lock:
            self.counters.prefix_cache_queries += len(prompt)
            self.counters.prefix_cache_hits += depth * size
        return leased, depth * size

    def commit(self, step: ScheduledStep, requests: dict[str, Request]) -> None:
        """Publish the step's full blocks, keep the checkpoints captured at their ends, release pins."""
        super().commit(step, requests)
        size = self.blocks.block_size
        for seq in step.seqs:
            self._unpin(seq.request_id)  # its first step ran: the state was copied into its seat
            tracked = self._tracked.get(seq.request_id)
            if tracked is None:
                continue
            end = seq.start_pos + len(seq.token_ids)
            for position in range(seq.start_pos // size * size + size, end + 1, size):
                key = tracked.keys[position // size - 1]
                if key in self.slot_of or key not in self.table:
                    continue
                if not self.store.has_capture(seq.request_id, position):
                    continue  # not a checkpoint position
                slot = self._take_slot()
                if slot is None:
                    break  # every slot is pinned by a waiting joiner
                self.store.save(seq.request_id, position, slot)
                self.slot_of[key] = slot
                self.key_of_slot[slot] = key
                self.slot_lru[slot] = None

    def forget(self, request: Request) -> None:
        super().forget(request)
        if self._unpin(request.request_id):
            self.store.cancel_restore(request.request_id)  # it left before its first step

    # ---- slots ----
    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        victim = next((s for s in self.slot_lru if not self.pins[s]), None)
        if victim is None:
            return None
        self._drop_checkpoint(victim)
        self.state_evictions += 1
        return self.free_slots.pop()

    def _drop_checkpoint(self, slot: int) -> None:
        if self.pins[slot]:
            raise AssertionError(f"state slot {slot} is dropped while a joiner waits to restore from it")
        del self.slot_of[self.key_of_slot.pop(slot)]
        del self.slot_lru[slot]
        self.free_slots.append(slot)

    def _unpin(self, request_id: str) -> bool:
        slot = self.pin_of.pop(request_id, None)
        if slot is None:
            return False
        self.pins[slot] -= 1
        return True

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "state_checkpoints": len(self.slot_of), "free_state_slots": len(self.free_slots),
                "state_evictions": self.state_evictions}

    def check_no_leaks(self) -> None:
        """Nothing pinned, every slot free or holding the checkpoint of a published block."""
        if self.pin_of or any(self.pins.values()):
            raise AssertionError(f"state slots still pinned: {dict(self.pin_of)}")
        if len(self.free_slots) + len(self.slot_of) != self.store.num_slots:
            raise AssertionError(f"{len(self.free_slots)} free + {len(self.slot_of)} kept != "
                                 f"{self.store.num_slots} state slots")
        if any(key not in self.table for key in self.slot_of):
            raise AssertionError("a checkpoint outlived its block")
