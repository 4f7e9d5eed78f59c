"""FCFS admission at step boundaries and step building under a token budget.

``schedule()`` runs at a boundary: cancelled requests leave, the queue head
joins while it may, and a step is built. ``update(step, output)`` advances the
requests of that step, streams their tokens and frees what finished. The
scheduler never touches a model: it exchanges frozen steps and outputs.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Protocol

from ifb.counters import SchedulingCounters
from ifb.kv import BlockManager
from ifb.outputs import Deliveries, RequestOutput, TokenLogprob
from ifb.request import Request, Status
from ifb.runtime import ScheduledSeq, ScheduledStep, StepOutput, Tokenizer

log = logging.getLogger("ifb.scheduler")


class PrefixMatcher(Protocol):
    """Finds published KV blocks a new request can lease (the context cache plugin)."""

    def match(self, request: Request) -> tuple[list[int], int]:
        """Return (block_ids already leased for the request, number of tokens they hold)."""

    def commit(self, step: ScheduledStep, requests: dict[str, Request]) -> None:
        """The step finished: publish the full blocks it computed."""

    def forget(self, request: Request) -> None:
        """The request left; drop any per-request bookkeeping."""


class Scheduler:
    def __init__(
        self,
        *,
        num_seats: int,
        token_budget: int,
        blocks: BlockManager,
        tokenizer: Tokenizer,
        max_model_len: int,
        counters: SchedulingCounters | None = None,
        batch_wide_sampling: bool = False,
        batch_wide_length: bool = False,
        static_batching: bool = False,
        release: Callable[[Request], None] = lambda r: None,
        prefix: PrefixMatcher | None = None,
    ):
        if token_budget < num_seats:
            raise ValueError(f"the token budget ({token_budget}) must cover one decode token per seat ({num_seats})")
        self.num_seats = num_seats
        self.token_budget = token_budget
        self.blocks = blocks
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.counters = counters or SchedulingCounters()
        self.batch_wide_sampling = batch_wide_sampling
        self.batch_wide_length = batch_wide_length
        self.static_batching = static_batching
        self.release = release
        self.prefix = prefix
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self._free_seats = list(range(num_seats))
        self._batch_key: tuple | None = None
        self._batch_length: int | None = None
        self._step_id = 0
        self.listeners: list = []  # objects with on_token(req, now) / on_finish(req, now)
        #: while update() runs: async consumers' outputs, handed over once at its end
        self._deliveries: Deliveries | None = None
        #: why each request that is not in the last step was left out (for tests and debugging)
        self.exclusions: dict[str, str] = {}

    # ---- intake ----
    def add(self, request: Request) -> None:
        with self.counters.lock:
            self.counters.queued += 1
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, request: Request) -> int:
        return self.blocks.blocks_for(request.num_prompt_tokens + request.max_tokens)

    # ---- admission ----
    def head_may_join(self, head: Request) -> str | None:
        """Why the queue head cannot join the running batch now (a stall counter), or None."""
        if not self.running:
            return None  # it founds the next batch
        if head.runs_alone or any(r.runs_alone for r in self.running):
            return "stalls_guided"
        if head.founder_only is not None:
            return head.founder_only.stall_counter
        if self.batch_wide_sampling and head.params.batch_key() != self._batch_key:
            return "stalls_incompatible"
        if self.batch_wide_length and head.max_tokens != self._batch_length:
            return "stalls_incompatible"  # generation length is a batch-wide setting here
        if not self.blocks.can_allocate(self._blocks_needed(head)):
            return "stalls_no_capacity"
        return None

    def _admit_at_boundary(self, reset_seats: list[int]) -> str | None:
        """Seat queue heads while they may join; return why the head (if any) stays queued."""
        founding = not self.running
        while self.waiting:
            if not self._free_seats:
                return "no free seat"
            if self.static_batching and not founding:
                return "static batching: the running batch drains first"
            head = self.waiting[0]
            stall = self.head_may_join(head)
            if stall is not None:
                with self.counters.lock:
                    self.counters.stall(stall)
                return stall
            if not self.running:
                self._fit_founder(head)
            self._seat(head, mid_flight=not founding)
            reset_seats.append(head.seat)
        return None

    def _fit_founder(self, head: Request) -> None:
        # A founder that cannot fit the whole cache even alone runs with a clamped length.
        room = self.blocks.num_free * self.blocks.block_size - head.num_prompt_tokens
        head.max_tokens = max(1, min(head.max_tokens, room))

    def _seat(self, head: Request, mid_flight: bool) -> None:
        self.waiting.popleft()
        now = time.monotonic()
        leased, num_cached = self.prefix.match(head) if self.prefix else ([], 0)
        new_blocks = self._blocks_needed(head) - len(leased)
        head.block_ids = leased + self.blocks.allocate(max(0, new_blocks))
        head.num_computed_tokens = num_cached
        self._free_seats.sort()
        head.seat = self._free_seats.pop(0)
        head.status = Status.RUNNING
        head.admitted_time = now
        if not self.running:
            self._batch_key = head.params.batch_key()
            self._batch_length = head.max_tokens
        self.running.append(head)
        with self.counters.lock:
            self.counters.queued -= 1
            self.counters.resident += 1
            self.counters.admitted(int((now - head.arrival_time) * 1e6), mid_flight)

    # ---- boundary ----
    def schedule(self) -> ScheduledStep | None:
        """Run one boundary and return the next step, or None when there is nothing to run."""
        for request in [r for r in (*self.running, *self.waiting) if r.handle.cancelled.is_set()]:
            self.finish(request, "cancelled")
        reset_seats: list[int] = []
        head_reason = self._admit_at_boundary(reset_seats)
        self.exclusions = {}
        for i, r in enumerate(self.waiting):
            self.exclusions[r.request_id] = head_reason if i == 0 else "behind the queue head (FCFS)"
        if not self.running:
            return None
        budget = self.token_budget
        seqs = []
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for r in decoding + prefilling:
            if budget == 0:
                self.exclusions[r.request_id] = "token budget spent"
                continue
            num_new = min(r.num_tokens - r.num_computed_tokens, budget)
            budget -= num_new
            seqs.append(self._scheduled_seq(r, num_new))
        self._step_id += 1
        return ScheduledStep(step_id=self._step_id, seqs=tuple(seqs), reset_seats=tuple(reset_seats))

    def _scheduled_seq(self, r: Request, num_new: int) -> ScheduledSeq:
        start = r.num_computed_tokens
        all_ids = r.all_token_ids()
        return ScheduledSeq(
            request_id=r.request_id, seat=r.seat, token_ids=tuple(all_ids[start:start + num_new]),
            start_pos=start, block_ids=tuple(r.block_ids), is_sampling=start + num_new == len(all_ids),
            params=r.params, num_prompt_tokens=r.num_prompt_tokens, all_token_ids=tuple(all_ids),
            extras=r.extras,
        )

    # ---- results ----
    def update(self, step: ScheduledStep, output: StepOutput) -> None:
        """Advance the step's requests with its output; stream tokens; free what finished."""
        if self.prefix is not None:
            self.prefix.commit(step, self.requests)
        now = time.monotonic()
        self._deliveries = Deliveries()
        try:
            for seq, out in zip(step.seqs, output.seqs, strict=True):
                r = self.requests.get(seq.request_id)
                if r is None or r.status is not Status.RUNNING:
                    continue
                r.num_computed_tokens += len(seq.token_ids)
                if not seq.is_sampling:
                    continue
                self._append_token(r, out, now)
        finally:
            deliveries, self._deliveries = self._deliveries, None
            deliveries.flush()

    def _append_token(self, r: Request, out, now: float) -> None:
        token = out.token_id
        r.output_token_ids.append(token)
        if r.first_token_time is None:
            r.first_token_time = now
        is_eos = token in r.eos_token_ids and not r.params.ignore_eos
        logprob = self._logprob(token, out) if out.logprob is not None else None
        if not is_eos:
            r.detok.add(token, logprob)  # it goes out with the text it starts (not at all if a stop string's)
        token_ids, logprobs = ((token,), (logprob,) if logprob is not None else ()) if is_eos else ((), ())
        for listener in self.listeners:
            listener.on_token(r, now)
        with self.counters.lock:
            self.counters.generation_tokens += 1
        reason = None
        if is_eos or token in r.params.stop_token_ids or r.detok.stopped:
            reason = "stop"
        elif len(r.output_token_ids) >= r.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.finish(r, reason, token_ids=token_ids, logprobs=logprobs)
        else:
            text = r.detok.release(final=False)
            token_ids, logprobs = r.detok.release_tokens(final=False)
            r.handle.push(RequestOutput(
                request_id=r.request_id, text=text, token_ids=token_ids,
                num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=len(r.output_token_ids),
                logprobs=logprobs, index=r.index,
            ), self._deliveries)

    def _logprob(self, token: int, out) -> TokenLogprob:
        decode = self.tokenizer.decode
        return TokenLogprob(
            token_id=token, token=decode([token], skip_special_tokens=False), logprob=out.logprob,
            top_logprobs=tuple((t, decode([t], skip_special_tokens=False), lp) for t, lp in out.top_logprobs),
        )

    def fail_step(self, step: ScheduledStep, error: BaseException) -> None:
        """A fault in a step fails exactly that step's requests; the engine goes on."""
        message = f"the engine failed this request's step: {type(error).__name__}: {error}"
        for seq in step.seqs:
            r = self.requests.get(seq.request_id)
            if r is not None and r.status is not Status.FINISHED:
                self.finish(r, "error", error=message)

    def finish(self, r: Request, reason: str, *, error: str | None = None,
               token_ids: tuple[int, ...] = (), logprobs: tuple = ()) -> None:
        """Move a request to its one terminal state and free its seat and blocks."""
        was = r.status
        if was is Status.FINISHED:
            return
        r.status = Status.FINISHED
        r.finish_reason = reason
        self.requests.pop(r.request_id, None)
        if was is Status.RUNNING:
            self.running.remove(r)
            self.blocks.free(r.block_ids)
            r.block_ids = []
            self._free_seats.append(r.seat)
            if self.prefix is not None:
                self.prefix.forget(r)
            try:
                self.release(r)
            except Exception:  # noqa: BLE001 - the request still gets its final output
                log.exception("runtime release failed for %s", r.request_id)
        else:
            self.waiting.remove(r)
        terminal = {"cancelled": "cancelled", "error": "failed"}.get(reason, "completed")
        with self.counters.lock:
            if was is Status.RUNNING:
                self.counters.resident -= 1
            else:
                self.counters.queued -= 1
            setattr(self.counters, terminal, getattr(self.counters, terminal) + 1)
            self.counters.prompt_tokens += r.num_prompt_tokens if was is Status.RUNNING else 0
        if reason in ("stop", "length"):
            r.detok.flush()
        now = time.monotonic()
        for listener in self.listeners:
            listener.on_finish(r, now)
        text = r.detok.release(final=True)
        held_ids, held_logprobs = r.detok.release_tokens(final=True)
        r.handle.push(RequestOutput(
            request_id=r.request_id, text=text, token_ids=held_ids + token_ids,
            finished=True, finish_reason=reason, num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=len(r.output_token_ids) - r.detok.num_dropped,
            logprobs=held_logprobs + logprobs, error=error, index=r.index,
        ), self._deliveries)
