"""FCFS admission at step boundaries, KV blocks on demand, preemption, step building.

``schedule()`` runs at a boundary: cancelled requests leave, the queue head
joins while it may, a step is planned under the token budget, and each planned
request gets the KV blocks its share of the step needs. When the pool cannot
cover a share, the most recently admitted residents are preempted: they leave
their seats, their blocks are freed, and they go back to the head of the
queue, where they are recomputed from their prompt plus the tokens they have
already generated (nothing streamed is sent again). ``update(step, output)``
advances the requests of that step, streams their tokens and frees what
finished. The scheduler never touches a model: it exchanges frozen steps and
outputs, and a step carries only what changed (a seated request's tokens and
state once, then per step its new tokens and blocks). It is also the only code
that moves its counters.

Where the runtime declares speculative decoding (``ifb.speculative``), a
decoder may get ``1 + k`` positions: its last token and ``k`` the runtime drafts
and verifies in the same forward. ``SpeculationPolicy`` picks ``k`` per request
and per step; ``update`` appends the accepted drafts and the target's own next
token (stop strings, stop ids, EOS and ``max_tokens`` judged token by token, so
nothing past a stop is emitted), advances ``num_computed_tokens`` by what was
accepted and frees the blocks only rejected drafts had used.

The blocking path is this scheduler with one seat: requests run one at a time,
a request waiting longer than ``queue_timeout`` fails with ``QUEUE_TIMEOUT``, and
an n > 1 request is fanned out into its sequences, which run one after another
and are counted as one request. Under in-flight batching the n sequences take
their seats together and share one prefill of the prompt (``ifb.fork``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import attrs
from typing import Callable, Iterable

from ifb import fork
from ifb.counters import SchedulingCounters
from ifb.kv import BlockManager, PrefixMatcher, WindowTable  # noqa: F401 - PrefixMatcher is named here too
from ifb.outputs import QUEUE_TIMEOUT, Deliveries, RequestOutput, TokenLogprob
from ifb.request import Request, RequestGroup, Status
from ifb.runtime import NewSeq, ScheduledSeq, ScheduledStep, SeqOutput, StepOutput, Tokenizer, WindowBlocks
from ifb.speculative import DraftStats, SpeculationCaps

log = logging.getLogger("ifb.scheduler")


def default_watermark(num_blocks: int) -> int:
    """Blocks a joiner must leave free beyond its own prefill: 1 % of the pool, at least one."""
    return max(1, num_blocks // 100)


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
        watermark: int | None = None,
        queue_timeout: float | None = None,
        finish_output: Callable[[Request, RequestOutput], Iterable[RequestOutput]] | None = None,
        speculation: SpeculationCaps | None = None,
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
        #: the spec's batch-wide generation length: a joiner's max_tokens must equal the founder's and
        #: its whole prompt + max_tokens is reserved at admission, so nobody is ever preempted
        self.batch_wide_length = batch_wide_length
        self.static_batching = static_batching
        self.release = release
        self.prefix = prefix
        #: seconds a request may wait for its first seat before it fails (None: no limit)
        self.queue_timeout = queue_timeout
        #: the runtime's replacement of a finishing request's final output (``Runtime.finish_output``)
        self.finish_output = finish_output
        #: the runtime's speculative decoding (None: it verifies no drafts)
        self.speculation = speculation
        if speculation is not None:
            self.counters.speculation = type(self.counters.speculation)(speculation.max_num_drafts)
        #: free blocks a joiner must leave beyond its prefill, plus one per resident (room to grow)
        self.watermark = default_watermark(blocks.num_blocks) if watermark is None else watermark
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        #: the number of steps built so far (the last step's id)
        self.num_steps = 0
        self.listeners: list = []  # objects with on_token(req, now) / on_finish(req, now)
        #: why each request that is not in the last step was left out (for tests and debugging)
        self.exclusions: dict[str, str] = {}
        self._free_seats = list(range(num_seats))
        self._batch_key: tuple | None = None
        self._batch_length: int | None = None
        #: requests submitted from other threads, taken in at the next boundary
        self._inbox: list[Request] = []
        self._inbox_lock = threading.Lock()
        #: while update() runs: async consumers' outputs, handed over once at its end
        self._deliveries: Deliveries | None = None
        #: requests seated since the last step was built: they go to the runtime once, as ``NewSeq``
        self._new: dict[str, Request] = {}
        #: KV blocks to copy (src, dst) before the next step's forward, per KV group (the full-attention
        #: pool's, then each window group's): n > 1 sequences forking
        self._copies: list[list[tuple[int, int]]] = [[] for _ in range(1 + len(blocks.window_groups))]

    # ---- intake ----
    def submit(self, request: Request | list[Request], max_in_system: int | None = None) -> bool:
        """Count and queue a request from any thread; False (counted refused) when the system is full.

        A list is the sequences of one n > 1 request (``fan_out``): counted as one.
        """
        with self._inbox_lock:
            if not self.counters.submit(max_in_system):
                return False
            self._inbox.extend(request if isinstance(request, list) else [request])
        return True

    def add(self, request: Request) -> None:
        """Count and queue a request now (the thread that runs the boundaries)."""
        self.counters.submit()
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for request in inbox:
            self._enqueue(request)

    @property
    def has_work(self) -> bool:
        with self._inbox_lock:
            return bool(self.waiting or self.running or self._inbox)

    # ---- admission ----
    def _admission_blocks(self, request: Request) -> int:
        if self.batch_wide_length:
            return self.blocks.blocks_for(request.num_prompt_tokens + request.max_tokens)
        # its prefill (prompt + tokens already generated), plus an n > 1 request's copies of its last block
        return fork.blocks_needed(request, self.blocks)

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
        reserve = 0 if self.batch_wide_length else self.watermark + len(self.running)
        # a window group needs only the window of the prefill's first chunk (its blocks slide from there)
        if not self.blocks.can_admit(self._admission_blocks(head), min(head.num_tokens, self.token_budget), reserve,
                                     len(self.running), whole=self.batch_wide_length):
            return "stalls_no_capacity"
        return None

    def _admit_at_boundary(self) -> str | None:
        """Seat queue heads while they may join; return why the head (if any) stays queued."""
        founding = not self.running
        while self.waiting:
            if not self._free_seats:
                return "no free seat"
            if self.static_batching and not founding:
                return "static batching: the running batch drains first"
            head = self.waiting[0]
            if len(self._free_seats) < fork.seats_needed(head):
                return "no free seat"  # an n > 1 request takes its n seats together
            stall = self.head_may_join(head)
            if stall is not None:
                self.counters.stall(stall)
                return stall
            if not self.running and self.batch_wide_length:
                self._fit_founder(head)
            self._seat(head, mid_flight=not founding)
            for follower in head.group.followers if head.group is not None and head.group.leader is head else ():
                self.waiting.remove(follower)
                self.waiting.appendleft(follower)
                self._seat(follower, mid_flight=not founding, is_follower=True)
        return None

    def _fit_founder(self, head: Request) -> None:
        # With a batch-wide length the founder's whole length is reserved: one that cannot fit the
        # cache even alone runs with a clamped length.
        room = self.blocks.num_free * self.blocks.block_size - head.num_prompt_tokens
        head.max_tokens = max(1, min(head.max_tokens, room))

    def _seat(self, head: Request, mid_flight: bool, is_follower: bool = False) -> None:
        self.waiting.popleft()
        now = time.monotonic()
        head.window_tables = [WindowTable() for _ in self.blocks.window_groups]
        # a follower's blocks come from its leader when it forks
        leased, num_cached = self.prefix.match(head) if self.prefix and not is_follower else ([], 0)
        if num_cached and any(t.num_entries != len(leased) for t in head.window_tables):
            self.blocks.free_all(leased, head.window_tables)  # a hit the window groups do not hold: computed again
            leased, num_cached = [], 0
        head.block_ids = leased
        if self.batch_wide_length:
            self.blocks.grow_all(head.block_ids, head.window_tables, max(0, self._admission_blocks(head) - len(leased)))
        head.num_computed_tokens = num_cached
        self._free_seats.sort()
        head.seat = self._free_seats.pop(0)
        head.status = Status.RUNNING
        if not self.running:
            self._batch_key = head.params.batch_key()
            self._batch_length = head.max_tokens
        self.running.append(head)
        head.num_sent_blocks = 0
        head.num_dropped_blocks = 0
        if self.speculation is not None and head.drafts is None:
            off = None if head.spec.speculative else "the request asked for no speculation"
            if off is None and not head.supports_drafts:
                off = "its runtime verifies no drafts for it (a grammar-constrained request)"
            head.drafts = DraftStats(self.speculation.policy.prior_acceptance, off_reason=off)
        self._new[head.request_id] = head
        if head.group is not None and head.group.is_seated:
            head.admitted_time = now  # a later sequence of a request already counted as seated
        elif head.num_preemptions:
            self.counters.seat(None, mid_flight)  # coming back: its queue latency was counted once
        else:
            head.admitted_time = now
            self.counters.seat(int((now - head.arrival_time) * 1e6), mid_flight)
        if head.group is not None:
            head.group.is_seated = True

    # ---- boundary ----
    def schedule(self) -> ScheduledStep | None:
        """Run one boundary and return the next step, or None when there is nothing to run."""
        self._take_inbox()
        for request in [r for r in (*self.running, *self.waiting) if r.handle.cancelled.is_set()]:
            self.finish(request, "cancelled")
        if self.queue_timeout is not None:
            self._time_out_waiting()
        while True:
            head_reason = self._admit_at_boundary()
            self.exclusions = {}
            for i, r in enumerate(self.waiting):
                self.exclusions[r.request_id] = head_reason if i == 0 else "behind the queue head (FCFS)"
            if not self.running:
                return None
            shares = self._grow(self._plan())
            if shares:
                break
            # everyone planned was preempted or ran out of cache: the next boundary now
        self.num_steps += 1
        new, self._new = self._new, {}
        new_seqs = tuple(NewSeq(request_id=r.request_id, seat=r.seat, token_ids=tuple(r.all_token_ids()),
                                num_prompt_tokens=r.num_prompt_tokens, params=r.params, state=r.state,
                                kv_salt=r.kv_salt)
                         for r in new.values())
        copies = tuple(tuple(group) for group in self._copies)
        self._copies = [[] for _ in self._copies]
        return ScheduledStep(step_id=self.num_steps, seqs=tuple(self._scheduled_seq(r, n) for r, n in shares),
                             new_seqs=new_seqs, block_copies=copies[0], window_block_copies=copies[1:])

    def _time_out_waiting(self) -> None:
        """Fail each queued request that has waited past the queue time-out for its first seat."""
        now = time.monotonic()
        for r in list(self.waiting):
            if r.num_preemptions or (r.group is not None and r.group.is_seated):
                continue  # it has had a seat: its wait is over
            if now - r.arrival_time > self.queue_timeout:
                self.finish(r, "error", error=f"timed out after {self.queue_timeout:g} s in the queue",
                            error_code=QUEUE_TIMEOUT)

    def _plan(self) -> list[tuple[Request, int]]:
        """Each resident's share of the step: decode tokens first, then prefill chunks in admission order,
        then, from what the budget has left, drafts for the decoders that speculate (a draft only may speed
        a decoder up; a prefill chunk is owed)."""
        budget = self.token_budget
        plan = []
        for group, forked in zip(self._copies, fork.fork_ready(self.running, self.blocks)):
            group += forked
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for r in decoding + prefilling:
            if fork.is_waiting_to_fork(r):
                self.exclusions[r.request_id] = fork.WAITS_FOR_LEADER
                continue
            if budget == 0:
                self.exclusions[r.request_id] = "token budget spent"
                continue
            num_new = min(r.num_tokens - r.num_computed_tokens, budget, fork.leader_cap(r) or budget)
            budget -= num_new
            plan.append((r, num_new))
        if self.speculation is not None and budget:
            for i, (r, num_new) in enumerate(plan[:len(decoding)]):
                k = min(self._num_drafts(r, len(decoding)), budget)
                budget -= k
                plan[i] = (r, num_new + k)
        return plan

    def _num_drafts(self, r: Request, num_decoding: int) -> int:
        """The drafts the policy gives decoder ``r`` this step (0: a plain decode)."""
        stats = r.drafts
        if stats is None or stats.off_reason is not None:
            return 0
        # past max_tokens or the context no draft could be emitted: the step yields at most k + 1 tokens
        room = min(self.speculation.max_num_drafts, r.max_tokens - len(r.output_token_ids) - 1,
                   self.max_model_len - r.num_tokens - 1)
        return self.speculation.policy.num_drafts(stats.acceptance, room, num_decoding)

    def _grow(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Give each planned share its KV blocks, oldest resident first; preempt the youngest when short.

        A prefill chunk shrinks to what fits before anyone is preempted. A lone
        resident that outgrows the whole pool finishes with ``length``.
        """
        order = {id(r): i for i, r in enumerate(self.running)}
        granted: dict[int, int] = {}
        for r, num_new in sorted(plan, key=lambda share: order[id(share[0])]):
            if r.status is not Status.RUNNING:
                continue  # preempted for an older resident in this same step
            self.blocks.slide(r.window_tables, r.num_computed_tokens)  # what no later query sees goes back first
            need = self._blocks_to_grow(r, num_new)
            while need > self.blocks.num_free_in_every_group:
                fit = ((len(r.block_ids) + self.blocks.num_free_in_every_group) * self.blocks.block_size
                       - r.num_computed_tokens)
                if 1 <= fit < num_new:
                    num_new = fit
                elif self.running[-1] is not r:
                    self.preempt(self.running[-1])
                else:
                    break
                need = self._blocks_to_grow(r, num_new)
            if need > self.blocks.num_free_in_every_group:
                if len(self.running) == 1:
                    self.finish(r, "length")  # the context reached the KV cache's capacity
                else:
                    self.preempt(r)
                continue
            self.blocks.grow_all(r.block_ids, r.window_tables, need)
            granted[id(r)] = num_new
        return [(r, granted[id(r)]) for r, _ in plan if id(r) in granted and r.status is Status.RUNNING]

    def _blocks_to_grow(self, r: Request, num_new: int) -> int:
        return max(0, self.blocks.blocks_for(r.num_computed_tokens + num_new) - len(r.block_ids))

    def preempt(self, r: Request) -> None:
        """Send a resident back to the head of the queue; it is recomputed when it is seated again.

        Its blocks are freed (a context cache keeps the published ones for
        reuse) and its per-seat runtime state is released. Its generated tokens
        stay: they are prefilled again with the prompt, never streamed again.
        """
        self._vacate(r)
        r.status = Status.WAITING
        r.seat = None
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        # victims leave youngest first, so putting each at the head keeps the queue in arrival order
        self.waiting.appendleft(r)
        self.exclusions[r.request_id] = "preempted: the KV pool ran out"
        self.counters.preempt(is_sequence=r.group is not None)
        log.debug("preempted %s (%d tokens to recompute)", r.request_id, r.num_tokens)

    def _vacate(self, r: Request) -> None:
        self.running.remove(r)
        fork.leave(r)
        self._new.pop(r.request_id, None)
        self.blocks.free_all(r.block_ids, r.window_tables)
        r.block_ids = []
        self._free_seats.append(r.seat)
        if self.prefix is not None:
            self.prefix.forget(r)
        try:
            self.release(r)
        except Exception:  # noqa: BLE001 - the request goes on (or still gets its final output)
            log.exception("runtime release failed for %s", r.request_id)

    def _scheduled_seq(self, r: Request, num_new: int) -> ScheduledSeq:
        start = r.num_computed_tokens
        num_prompt = r.num_prompt_tokens
        num_drafts = max(0, start + num_new - r.num_tokens)  # positions past the last known token
        num_new -= num_drafts
        # the tokens computed this step, without copying the history: a slice of the prompt, of the
        # output, or (a chunk that crosses from one to the other) of both
        if start + num_new <= num_prompt:
            token_ids = tuple(r.prompt_token_ids[start:start + num_new])
        elif start >= num_prompt:
            token_ids = tuple(r.output_token_ids[start - num_prompt:start - num_prompt + num_new])
        else:
            token_ids = tuple(r.prompt_token_ids[start:]) + tuple(r.output_token_ids[:start + num_new - num_prompt])
        new_block_ids = tuple(r.block_ids[r.num_sent_blocks:])
        r.num_sent_blocks = len(r.block_ids)
        num_dropped, r.num_dropped_blocks = r.num_dropped_blocks, 0
        windows = tuple(WindowBlocks(*change) for change in self.blocks.window_changes(r.window_tables))
        return ScheduledSeq(request_id=r.request_id, seat=r.seat, token_ids=token_ids, start_pos=start,
                            new_block_ids=new_block_ids, is_sampling=start + num_new == r.num_tokens,
                            num_draft_tokens=num_drafts, num_dropped_blocks=num_dropped, window_blocks=windows)

    # ---- results ----
    def update(self, step: ScheduledStep, output: StepOutput) -> None:
        """Advance the step's requests with its output; stream tokens; free what finished."""
        if self.prefix is not None:
            self.prefix.commit(step, self.requests)
        now = time.monotonic()
        self._deliveries = Deliveries()
        verified = []
        try:
            for seq, out in zip(step.seqs, output.seqs, strict=True):
                r = self.requests.get(seq.request_id)
                if r is None or r.status is not Status.RUNNING:
                    continue
                self.counters.add_computed_prompt_tokens(
                    max(0, min(seq.start_pos + len(seq.token_ids), r.num_prompt_tokens) - seq.start_pos))
                # the accepted drafts' positions were computed (their KV is right); the rejected ones' are not
                r.num_computed_tokens += len(seq.token_ids) + len(out.accepted)
                if not seq.is_sampling:
                    continue
                if out.token_id is None:  # no token finished this step: its last token is scheduled again
                    r.num_computed_tokens -= 1
                    continue
                if r.drafts is not None:
                    self._observe_drafts(r, out)
                    verified.append((out.num_drafted, len(out.accepted)))
                outs = (*out.accepted, out, *(SeqOutput(out.request_id, t) for t in out.more_token_ids))
                if self._append_tokens(r, outs, now) and seq.num_draft_tokens and not self.batch_wide_length:
                    self._drop_rejected_blocks(r)
        finally:
            deliveries, self._deliveries = self._deliveries, None
            deliveries.flush()
            self.counters.speculation.record_step(verified)

    def _observe_drafts(self, r: Request, out: SeqOutput) -> None:
        r.drafts.observe(self.speculation.policy, out.num_drafted, len(out.accepted))
        if out.speculation_error is not None and r.drafts.off_reason is None:
            r.drafts.off_reason = f"drafting failed: {out.speculation_error}"
            self.counters.speculation.record_failure()
            log.warning("%s goes on without drafts: %s", r.request_id, out.speculation_error)

    def _drop_rejected_blocks(self, r: Request) -> None:
        """Free the blocks past what ``r`` needs now: only rejected drafts had used them."""
        keep = self.blocks.blocks_for(r.num_tokens)
        if len(r.block_ids) <= keep:
            return
        self.blocks.free(r.block_ids[keep:])
        del r.block_ids[keep:]
        self.blocks.drop_window_tails(r.window_tables, keep)
        if r.num_sent_blocks > keep:
            r.num_dropped_blocks += r.num_sent_blocks - keep
            r.num_sent_blocks = keep

    def _append_tokens(self, r: Request, outs, now: float) -> bool:
        """Append a step's tokens to ``r`` one by one until one finishes it; stream what is released.
        Returns whether ``r`` is still running."""
        for out in outs:
            reason, token_ids, logprobs = self._append_token(r, out, now)
            if reason is not None:
                self.finish(r, reason, token_ids=token_ids, logprobs=logprobs)
                return False
        text = r.detok.release(final=False)
        token_ids, logprobs = r.detok.release_tokens(final=False)
        self._push(r, RequestOutput(
            request_id=r.handle.request_id, text=text, token_ids=token_ids,
            num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=len(r.output_token_ids),
            logprobs=logprobs, index=r.index,
        ))
        return True

    def _append_token(self, r: Request, out, now: float) -> tuple[str | None, tuple, tuple]:
        """Append one token; return the finish reason it brings (or None) and what ``finish`` must send."""
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
        self.counters.add_generation_tokens(1)
        reason = None
        if is_eos or token in r.params.stop_token_ids or r.detok.stopped:
            reason = "stop"
        elif len(r.output_token_ids) >= r.max_tokens or r.num_tokens >= self.max_model_len:
            reason = "length"
        elif r.num_tokens > self.blocks.num_blocks * self.blocks.block_size:
            reason = "length"  # the next token could not be computed: the context fills the whole KV cache
        return reason, token_ids, logprobs

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

    def finish(self, r: Request, reason: str, *, error: str | None = None, error_code: str | None = None,
               token_ids: tuple[int, ...] = (), logprobs: tuple = (),
               final: RequestOutput | None = None) -> None:
        """Move a request to its one terminal state and free its seat and blocks.

        ``final`` is the request's last output when it was made elsewhere (a request served whole);
        otherwise it is built here from what is still held back.
        """
        was = r.status
        if was is Status.FINISHED:
            return
        r.status = Status.FINISHED
        r.finish_reason = reason
        self.requests.pop(r.request_id, None)
        if was is Status.RUNNING:
            self._vacate(r)
        else:
            self.waiting.remove(r)
        group = r.group
        if group is not None:
            group.num_open -= 1
        if group is None or group.num_open == 0:
            self.counters.end(reason, was_resident=was is Status.RUNNING or (group is not None and group.is_seated),
                              num_prompt_tokens=r.num_prompt_tokens)
        is_made_here = final is None
        if final is None:
            if reason in ("stop", "length"):
                r.detok.flush()
            text = r.detok.release(final=True)
            held_ids, held_logprobs = r.detok.release_tokens(final=True)
            final = RequestOutput(
                request_id=r.handle.request_id, text=text, token_ids=held_ids + token_ids,
                finished=True, finish_reason=reason, num_prompt_tokens=r.num_prompt_tokens,
                num_output_tokens=len(r.output_token_ids) - r.detok.num_dropped,
                logprobs=held_logprobs + logprobs, error=error, error_code=error_code, index=r.index,
                stop_string=r.detok.matched_stop if reason == "stop" else None,
            )
        now = time.monotonic()
        for listener in self.listeners:
            listener.on_finish(r, now)
        outputs: Iterable[RequestOutput] = (final,)
        if self.finish_output is not None and is_made_here and reason in ("stop", "length"):
            try:
                outputs = list(self.finish_output(r, final))
            except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                log.exception("finishing %s failed", r.request_id)
                outputs = (attrs.evolve(final, finish_reason="error", error=f"{type(exc).__name__}: {exc}"),)
        for out in outputs:
            if group is not None:  # one of n sequences: the request ends with the last of them
                out = attrs.evolve(out, finished=out.finished and group.num_open == 0)
            self._push(r, out)

    def _push(self, r: Request, out: RequestOutput) -> None:
        """Send ``out`` to the request's handle; a ``best_of`` candidate's is held until the choice is made."""
        held = r.group.best_of if r.group is not None else None
        for sent in held.add(out) if held is not None else (out,):
            r.handle.push(sent, self._deliveries)

    def fail_all(self, message: str) -> None:
        """Fail everything still queued or seated with ``message`` (the runtime is lost)."""
        self._take_inbox()
        for request in [*self.running, *self.waiting]:
            self.finish(request, "error", error=message)

    def shutdown(self) -> None:
        """Cancel everything still queued or seated (the engine is stopping)."""
        self._take_inbox()
        for request in [*self.running, *self.waiting]:
            self.finish(request, "cancelled")
