"""The blocking path: one request at a time.

A stepped runtime is driven here directly, alone, through ``execute``
(``serve_alone``). What it adds of its own (a persistent block pool with
captured system prompts, an active LoRA adapter, audio made from the
answer) it says through one hook, ``plan_alone(request) -> AlonePlan``, which
runs no step itself. A runtime without stepped execution serves a request
through its ``handle_request``.

The default mode, and the only one for deployments the gate refuses. A
bounded queue holds waiting requests; a request that waits longer than the
queue timeout fails with a time-out instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Callable, ContextManager, Iterator

import attrs

from ifb.capabilities import DeployConfig, RequestOption
from ifb.counters import SchedulingCounters
from ifb.detok import IncrementalDetokenizer
from ifb.engine import EngineFull, check_options, new_request
from ifb.kv import BlockManager
from ifb.outputs import RequestHandle, RequestOutput
from ifb.params import RequestSpec
from ifb.request import Request
from ifb.runtime import Runtime, Tokenizer
from ifb.scheduler import PrefixMatcher, Scheduler

log = logging.getLogger("ifb.blocking")


def fork(request: Request, index: int, tokenizer: Tokenizer, **param_changes) -> Request:
    """A private copy of ``request`` for sequence ``index`` of an n > 1 request."""
    spec = attrs.evolve(request.spec, params=attrs.evolve(request.spec.params, n=1, **param_changes))
    return Request(
        request_id=f"{request.request_id}-{index}", spec=spec, prompt_token_ids=list(request.prompt_token_ids),
        max_tokens=request.max_tokens, handle=RequestHandle(f"{request.request_id}-{index}"),
        detok=IncrementalDetokenizer(tokenizer, request.prompt_token_ids, spec.params.stop),
        extras=dict(request.extras), eos_token_ids=request.eos_token_ids, index=index,
    )


@attrs.frozen
class AlonePlan:
    """What a stepped runtime adds to serving one request alone: its ``plan_alone(request)`` returns one.

    The default (``AlonePlan()``) is a fresh pool of the runtime's ``num_kv_blocks``,
    no prefix reuse, nothing around the drive and the outputs as they come.
    """

    #: the block bookkeeping the request is seated in; one that persists across requests keeps the
    #: blocks ``prefix`` hands out (None: a fresh pool for this request)
    blocks: BlockManager | None = None
    #: finds prompt KV already computed (a captured system prompt); None: every prompt is prefilled
    prefix: PrefixMatcher | None = None
    #: entered around the whole drive and left when it ends (an active LoRA adapter)
    context: ContextManager = attrs.field(factory=contextlib.nullcontext)
    #: maps the drive's outputs to the request's (audio spoken from the answer). It receives them
    #: lazily: a step runs only as it iterates, so one that never iterates them runs no step.
    finish: Callable[[Iterator[RequestOutput]], Iterator[RequestOutput]] | None = None


def serve_alone(runtime: Runtime, request: Request) -> Iterator[RequestOutput]:
    """Serve one request of a stepped runtime alone, as the runtime's ``plan_alone`` (if any) asks."""
    plan_alone = getattr(runtime, "plan_alone", None)
    plan = plan_alone(request) if plan_alone is not None else AlonePlan()
    with plan.context:
        outputs = drive_alone(runtime, request, blocks=plan.blocks, prefix=plan.prefix)
        yield from plan.finish(outputs) if plan.finish is not None else outputs


def drive_alone(runtime: Runtime, request: Request, *, token_budget: int = 512,
                blocks: BlockManager | None = None, prefix: PrefixMatcher | None = None,
                ) -> Iterator[RequestOutput]:
    """Serve one request through stepped execution with nobody else in the batch.

    A request with n > 1 runs its n sequences as one private batch (sequence i
    seeded with seed + i); ``finished`` is set on the output that ends the last
    sequence.
    """
    params = request.params
    children = [
        fork(request, i, runtime.tokenizer, **({"seed": params.seed + i} if params.seed is not None else {}))
        for i in range(params.n)
    ]
    blocks = blocks or BlockManager(runtime.num_kv_blocks, runtime.kv_block_size)
    scheduler = Scheduler(
        num_seats=len(children), token_budget=max(token_budget, len(children)), blocks=blocks,
        tokenizer=runtime.tokenizer, max_model_len=runtime.max_model_len,
        release=lambda r: runtime.release(r.request_id, r.seat), prefix=prefix,
    )
    for child in children:
        scheduler.add(child)
    num_done = 0
    while True:
        if request.handle.cancelled.is_set():
            for child in children:
                child.handle.cancelled.set()
        step = scheduler.schedule()
        if step is not None:
            try:
                scheduler.update(step, runtime.execute(step))
            except Exception as exc:  # noqa: BLE001 - the request fails; the server goes on
                log.exception("blocking-path step failed")
                scheduler.fail_step(step, exc)
        for child in children:
            for out in child.handle.ready():
                if out.finished:
                    num_done += 1
                yield attrs.evolve(out, request_id=request.request_id, finished=num_done == len(children))
        if step is None or num_done == len(children):
            return


class BlockingEngine:
    """Same surface as ``RequestEngine``, serving one request at a time."""

    is_in_flight = False

    def __init__(self, runtime: Runtime, config: DeployConfig, options: list[RequestOption],
                 reason: str | None = None):
        self.runtime = runtime
        self.config = config
        self.options = options
        self.reason = reason  # why in-flight batching is not possible, if it is not
        self.support = {o.name: runtime.caps.option(o) for o in options}
        self.counters = SchedulingCounters()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, config.max_queued_requests))
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ifb-blocking", daemon=True)
        self._thread.start()

    def submit(self, spec: RequestSpec, *, wait: bool = False, timeout: float | None = None) -> RequestHandle:
        check_options(self.options, self.support, spec, in_flight=False)
        request = new_request(self.runtime, spec)
        self.counters.submit()
        try:
            self._queue.put((request, time.monotonic()), block=wait, timeout=timeout)
        except queue.Full:
            self.counters.end("refused", was_resident=False)
            raise EngineFull(f"the queue is full ({self.config.max_queued_requests} waiting)") from None
        return request.handle

    def _run(self) -> None:
        while not self._stopping:
            try:
                request, queued_at = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            self._serve(request, queued_at)

    def _serve(self, request: Request, queued_at: float) -> None:
        waited = time.monotonic() - queued_at
        if request.handle.cancelled.is_set() or waited > self.config.queue_timeout:
            cancelled = request.handle.cancelled.is_set()
            self.counters.end("cancelled" if cancelled else "error", was_resident=False)
            request.handle.push(RequestOutput(
                request_id=request.request_id, text="", token_ids=(), finished=True,
                finish_reason="cancelled" if cancelled else "error",
                error=None if cancelled else f"timed out after {self.config.queue_timeout:g} s in the queue",
                extras={} if cancelled else {"status": 429}))
            return
        self.counters.seat(int(waited * 1e6), mid_flight=False)
        reason = "error"
        try:
            reason = self._forward(request, self._outputs(request))
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
            log.exception("blocking request failed")
            request.handle.push(RequestOutput(
                request_id=request.request_id, text="", token_ids=(), finished=True,
                finish_reason="error", error=f"{type(exc).__name__}: {exc}"))
        finally:
            self.counters.end(reason, was_resident=True, num_prompt_tokens=request.num_prompt_tokens)

    def _outputs(self, request: Request) -> Iterator[RequestOutput]:
        # a runtime without stepped execution serves the request itself; a stepped one is driven here
        handle_request = getattr(self.runtime, "handle_request", None)
        if handle_request is not None:
            return handle_request(request.spec, request)
        return serve_alone(self.runtime, request)

    def _forward(self, request: Request, outputs: Iterator[RequestOutput]) -> str:
        """Pass the runtime's outputs to the handle; return the finish reason."""
        last = None
        for out in outputs:
            last = out
            request.handle.push(out)
        if last is None or not request.handle.done.is_set():
            request.handle.push(RequestOutput(
                request_id=request.request_id, text="", token_ids=(), finished=True, finish_reason="stop"))
        return last.finish_reason if last is not None and last.finish_reason else "stop"

    def shutdown(self) -> None:
        self._stopping = True
        self._thread.join(timeout=30)

    def health(self) -> dict:
        return {"in_flight_batching": False, "max_num_seqs": 1}
