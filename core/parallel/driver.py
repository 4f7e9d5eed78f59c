"""Rank 0's runtime, which broadcasts each step before running its own shard, and the other ranks' loop.

Every collective runs under one lock, in the same order on every rank: the
step's command, then the model's all-reduces and the head's gather. While the
engine is idle a keep-alive goes out every third of the collective time-out,
so a rank that waits for the next step can tell an idle rank 0 from a dead
one. Any failure of a step on rank 0 is ``RankLost``: the ranks may have
fallen out of step, so the deployment cannot go on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ifb.parallel import ParallelContext, RankLost, wire
from ifb.runtime import ScheduledStep, StepOutput

log = logging.getLogger("ifb.parallel")


class DriverRuntime:
    """Rank 0's face of a multi-rank runtime: the engine's ``Runtime``, wrapping rank 0's shard.

    ``closers`` run at ``close`` after the ranks were told to stop (joining spawned processes), each
    given the seconds it may wait for them (short when a rank was lost: the others are ending too).
    """

    def __init__(self, inner: Any, ctx: ParallelContext, *, timeout: float,
                 closers: list[Callable[[float], None]] | None = None):
        self.inner = inner
        self.ctx = ctx
        self.timeout = timeout
        self.closers = list(closers or ())
        self._lock = threading.Lock()
        self._released: list[str] = []
        self._last = time.monotonic()
        self._lost: BaseException | None = None
        self._closed = threading.Event()
        #: the encoded size of each step's command, the latest first dropped (for benchmarks)
        self.command_bytes: list[int] = []
        #: called (from the keep-alive thread) when a rank is found lost while no step runs
        self.on_lost: list[Callable[[BaseException], None]] = []
        self._keepalive = threading.Thread(target=self._keep_alive, name="ifb-keepalive", daemon=True)
        self._keepalive.start()

    #: the legacy system-prompt capture prefills outside the steps, which the ranks would not see
    blocking_prefix = None

    def __getattr__(self, name: str) -> Any:  # model_name, caps, tokenizer, prepare, ... are the shard's
        return getattr(self.inner, name)

    # ---- the engine's calls (its actor thread) ----
    def execute(self, step: ScheduledStep) -> StepOutput:
        with self._lock:
            if self._lost is not None:
                raise RankLost(str(self._lost))
            released, self._released = tuple(self._released), []
            try:
                size = wire.send(wire.Command(wire.Kind.STEP, step, released), self.ctx.group)
                out = self.inner.execute(step)
            except Exception as exc:  # noqa: BLE001 - the ranks may be out of step now: nothing goes on
                self._lost = exc
                raise RankLost(f"tensor parallelism lost a rank during step {step.step_id} "
                               f"({type(exc).__name__}: {exc})") from exc
            finally:
                self._last = time.monotonic()
            self.command_bytes.append(size)
            del self.command_bytes[:-1024]
            return out

    def release(self, request_id: str, seat: int) -> None:
        self.inner.release(request_id, seat)
        self._released.append(request_id)

    # ---- liveness ----
    def _keep_alive(self) -> None:
        period = self.timeout / 3
        while not self._closed.wait(min(period, 1.0)):
            if time.monotonic() - self._last < period:
                continue
            with self._lock:
                if self._closed.is_set() or self._lost is not None:
                    return
                try:
                    wire.send(wire.Command(wire.Kind.KEEPALIVE), self.ctx.group)
                except Exception as exc:  # noqa: BLE001 - found while idle: the next step fails with it
                    log.error("tensor parallelism lost a rank while idle: %s", exc)
                    self._lost = exc
                    for callback in list(self.on_lost):
                        callback(RankLost(f"tensor parallelism lost a rank while idle ({exc})"))
                    return
                finally:
                    self._last = time.monotonic()

    def close(self) -> None:
        """Tell every rank to stop (when they still listen), leave the group, run the closers."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            if self._lost is None:
                try:
                    wire.send(wire.Command(wire.Kind.STOP), self.ctx.group)
                except Exception:  # noqa: BLE001 - a lost rank cannot be told; the closers end it
                    log.debug("telling the ranks to stop failed", exc_info=True)
        from ifb.parallel.group import leave_ranks

        leave_ranks()
        grace = 2.0 if self._lost is not None else 10.0
        for closer in self.closers:
            closer(grace)


def serve_shard(runtime: Any, ctx: ParallelContext) -> None:
    """A rank other than 0: run each step's shard as rank 0 sends it, until told to stop.

    Raises ``RankLost`` when rank 0 goes silent past the collective time-out or the group breaks.
    """
    while True:
        try:
            command = wire.receive(ctx.group)
        except Exception as exc:  # noqa: BLE001
            raise RankLost(f"rank {ctx.rank} lost rank 0 ({type(exc).__name__}: {exc})") from exc
        if command.kind is wire.Kind.STOP:
            return
        for request_id in command.released:
            runtime.release(request_id, -1)
        if command.kind is wire.Kind.STEP:
            try:
                runtime.execute_shard(command.step)
            except Exception as exc:  # noqa: BLE001
                raise RankLost(f"rank {ctx.rank} failed step {command.step.step_id} "
                               f"({type(exc).__name__}: {exc})") from exc
