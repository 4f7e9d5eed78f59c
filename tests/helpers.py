"""Helpers shared by the engine tests."""

from __future__ import annotations

import time


def submit_staggered(engine, specs, gap_steps: int = 2, timeout: float = 30.0):
    """Submit ``specs`` one by one, each after the previous one ran ``gap_steps`` engine steps.

    Later requests therefore arrive while earlier ones are generating and must
    join mid-flight. Returns the finished results in submission order.
    """
    handles = []
    for spec in specs:
        handle = engine.submit(spec, wait=True)
        handles.append(handle)
        deadline = time.monotonic() + timeout
        while handle.request_id not in engine.scheduler.requests and not handle.done.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("the engine never took the request")
            time.sleep(0.0005)
        target = engine.scheduler.num_steps + gap_steps
        while engine.scheduler.num_steps < target and not handle.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.0005)
    return [h.result() for h in handles]
