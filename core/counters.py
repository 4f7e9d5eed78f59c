"""The scheduling counters of ``/health``: always consistent, every request ends in one state.

Every change goes through one of the transition methods below, each under the
lock, so ``submitted == completed + cancelled + failed + refused + queued +
resident`` holds between any two of them. Under in-flight batching the
scheduler is the only caller; the blocking path's engine calls them itself.
"""

from __future__ import annotations

import threading

import attrs

STALL_COUNTERS = ("stalls_incompatible", "stalls_guided", "stalls_no_capacity")
#: terminal counter of each finish reason (anything else completed)
_TERMINAL = {"cancelled": "cancelled", "error": "failed", "refused": "refused"}


@attrs.define
class SchedulingCounters:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: int = 0
    admitted_mid_flight: int = 0
    #: times a resident left its seat for the queue head because the KV pool ran out
    preempted: int = 0
    stalls: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(STALL_COUNTERS, 0))
    queue_latency_total_us: int = 0
    queue_latency_max_us: int = 0
    num_admitted: int = 0
    queued: int = 0
    resident: int = 0
    # token-level counters for /metrics
    prompt_tokens: int = 0
    #: prompt tokens run through the model (a prefix-cache hit or a shared n > 1 prefill computes fewer)
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False, eq=False)

    # ---- transitions (each takes the lock) ----
    def submit(self, max_in_system: int | None = None) -> bool:
        """A request arrives: queued, or refused when ``max_in_system`` are already in. Returns whether queued."""
        with self.lock:
            self.submitted += 1
            if max_in_system is not None and self.queued + self.resident >= max_in_system:
                self.refused += 1
                return False
            self.queued += 1
            return True

    def seat(self, queue_latency_us: int | None, mid_flight: bool) -> None:
        """A queued request takes a seat; ``queue_latency_us`` None for a preempted one coming back."""
        with self.lock:
            self.queued -= 1
            self.resident += 1
            if queue_latency_us is None:
                return
            self.num_admitted += 1
            self.queue_latency_total_us += queue_latency_us
            self.queue_latency_max_us = max(self.queue_latency_max_us, queue_latency_us)
            if mid_flight:
                self.admitted_mid_flight += 1

    def preempt(self, *, is_sequence: bool = False) -> None:
        """A resident goes back to the queue; ``is_sequence``: one of an n > 1 request's sequences, whose
        request stays counted resident until it ends."""
        with self.lock:
            if not is_sequence:
                self.resident -= 1
                self.queued += 1
            self.preempted += 1

    def end(self, reason: str, *, was_resident: bool, num_prompt_tokens: int = 0) -> None:
        """A queued or resident request reaches its terminal state (by finish reason)."""
        terminal = _TERMINAL.get(reason, "completed")
        with self.lock:
            if was_resident:
                self.resident -= 1
                self.prompt_tokens += num_prompt_tokens
            else:
                self.queued -= 1
            setattr(self, terminal, getattr(self, terminal) + 1)

    def stall(self, counter: str) -> None:
        with self.lock:
            self.stalls[counter] = self.stalls.get(counter, 0) + 1

    def add_computed_prompt_tokens(self, num: int) -> None:
        if num:
            with self.lock:
                self.computed_prompt_tokens += num

    def add_generation_tokens(self, num: int) -> None:
        with self.lock:
            self.generation_tokens += num

    # ---- reading ----
    @property
    def in_system(self) -> int:
        with self.lock:
            return self.queued + self.resident

    def snapshot(self) -> dict[str, int]:
        """The ``scheduling`` block of ``/health``, in the spec's order (``preempted`` after the stalls)."""
        with self.lock:
            avg = self.queue_latency_total_us // self.num_admitted if self.num_admitted else 0
            out = {
                "submitted": self.submitted, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed, "refused": self.refused,
                "admitted_mid_flight": self.admitted_mid_flight,
            }
            out.update(self.stalls)
            out.update({
                "preempted": self.preempted,
                "queue_latency_avg_us": avg, "queue_latency_max_us": self.queue_latency_max_us,
                "queued": self.queued, "resident": self.resident,
            })
            return out

    def is_consistent(self) -> bool:
        with self.lock:
            ended = self.completed + self.cancelled + self.failed + self.refused
            return self.submitted == ended + self.queued + self.resident
