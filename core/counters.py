"""The scheduling counters of ``/health``: always consistent, every request ends in one state."""

from __future__ import annotations

import threading

import attrs

STALL_COUNTERS = ("stalls_incompatible", "stalls_guided", "stalls_no_capacity")


@attrs.define
class SchedulingCounters:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: int = 0
    admitted_mid_flight: int = 0
    stalls: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(STALL_COUNTERS, 0))
    queue_latency_total_us: int = 0
    queue_latency_max_us: int = 0
    num_admitted: int = 0
    queued: int = 0
    resident: int = 0
    # token-level counters for /metrics
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False, eq=False)

    def stall(self, counter: str) -> None:
        self.stalls[counter] = self.stalls.get(counter, 0) + 1

    def admitted(self, queue_latency_us: int, mid_flight: bool) -> None:
        self.num_admitted += 1
        self.queue_latency_total_us += queue_latency_us
        self.queue_latency_max_us = max(self.queue_latency_max_us, queue_latency_us)
        if mid_flight:
            self.admitted_mid_flight += 1

    def snapshot(self) -> dict[str, int]:
        """The ``scheduling`` block of ``/health``, in the spec's order."""
        with self.lock:
            avg = self.queue_latency_total_us // self.num_admitted if self.num_admitted else 0
            out = {
                "submitted": self.submitted, "completed": self.completed,
                "cancelled": self.cancelled, "failed": self.failed, "refused": self.refused,
                "admitted_mid_flight": self.admitted_mid_flight,
            }
            out.update(self.stalls)
            out.update({
                "queue_latency_avg_us": avg, "queue_latency_max_us": self.queue_latency_max_us,
                "queued": self.queued, "resident": self.resident,
            })
            return out

    def is_consistent(self) -> bool:
        with self.lock:
            ended = self.completed + self.cancelled + self.failed + self.refused
            return self.submitted == ended + self.queued + self.resident
