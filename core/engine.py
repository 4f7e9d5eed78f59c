"""The request engine: one actor thread owns the step loop.

``submit()`` is thread-safe: it validates at once, checks the request options
against the deployment's declaration (rejected options raise naming the
alternative), bounds admission to batch + queue, and returns a handle. The
actor runs boundaries and steps; nothing else touches the runtime.

One engine serves both modes. Under in-flight batching it has
``max_batch_size`` seats and the load-time gate's blessing. On the blocking
path (the default, and the only mode for what the gate refuses) it has one
seat, so requests run one at a time; a request that waits past the queue
time-out fails, an n > 1 request runs its sequences one after another, and a
runtime without stepped execution (or a request its runtime serves whole) is
driven through ``handle_request`` in that seat.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid

import attrs

from ifb.best_of import BestOf, candidate_params
from ifb.capabilities import DeployConfig, OptionSupport, RequestOption, Support
from ifb.counters import SchedulingCounters
from ifb.detok import IncrementalDetokenizer
from ifb.gate import UnsupportedDeployment, ifb_unsupported_reason
from ifb.kv import BlockManager, pool_for
from ifb.options import media_refusal
from ifb.outputs import RequestHandle, RequestOutput
from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb.request import Request, RequestGroup
from ifb.runtime import Runtime, RuntimeLost, ScheduledStep
from ifb.scheduler import PrefixMatcher, Scheduler

log = logging.getLogger("ifb.engine")


class RequestRejected(ValueError):
    """submit() refuses a request option this deployment cannot serve (HTTP 400); ``param``: the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineFull(RuntimeError):
    """Back-pressure: batch + queue are full (HTTP 429)."""


_ids = itertools.count()


def check_options(options: list[RequestOption], support: dict[str, OptionSupport], spec: RequestSpec,
                  *, in_flight: bool) -> tuple[OptionSupport | None, bool]:
    """Raise RequestRejected for an option the deployment refuses on this path.

    Returns (the founder-only support the request uses, whether it runs alone).
    """
    refusal = media_refusal(spec, support)
    if refusal is not None:
        raise RequestRejected(refusal)
    founder, alone = None, False
    for opt in options:
        if opt.relative_to_batch or not opt.uses(spec):
            continue
        declared = support[opt.name]
        param = opt.param(spec) if opt.param is not None else None
        alt = f" {declared.alternative}" if declared.alternative else ""
        if declared.support is Support.NOT_APPLICABLE:
            raise RequestRejected(f"{opt.title} is not supported by this deployment: {declared.reason}{alt}",
                                  param=param)
        if not in_flight:
            continue
        if declared.support is Support.REJECTED:
            raise RequestRejected(f"{opt.title} is not supported under in-flight batching: "
                                  f"{declared.reason}{alt}", param=param)
        if declared.support is Support.RUNS_ALONE:
            founder, alone = declared, True
        elif declared.support is Support.FOUNDER_ONLY and founder is None:
            founder = declared
    return founder, alone


def new_request(runtime: Runtime, spec: RequestSpec, on_cancel=None, index: int = 0) -> Request:
    """Validate and tokenize ``spec`` into a waiting Request (raises InvalidRequest)."""
    spec.validate()
    prepared = runtime.prepare(spec)
    num_prompt = len(prepared.prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequest("the prompt is empty after tokenization")
    room = runtime.max_model_len - num_prompt
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {num_prompt} tokens; this model's context is {runtime.max_model_len} tokens")
    capacity = runtime.num_kv_blocks * runtime.kv_block_size
    if num_prompt + 1 > capacity:
        raise InvalidRequest(f"the prompt has {num_prompt} tokens; the KV cache holds {capacity}")
    max_tokens = spec.params.max_tokens
    if max_tokens is None:
        max_tokens = room  # a cap: KV blocks are taken as the answer grows, never reserved for it
    elif max_tokens > room:
        raise InvalidRequest(
            f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
            f"context of {runtime.max_model_len} tokens")
    request_id = spec.request_id or f"req-{next(_ids)}-{uuid.uuid4().hex[:8]}"
    prompt_ids = list(prepared.prompt_token_ids)
    return Request(
        request_id=request_id, spec=spec, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
        handle=RequestHandle(request_id, on_cancel), state=prepared.state, kv_salt=prepared.kv_salt,
        num_unsalted_tokens=prepared.num_unsalted_tokens,
        is_served_whole=prepared.is_served_whole, num_pinned_tokens=prepared.num_pinned_tokens,
        supports_drafts=prepared.supports_drafts,
        detok=IncrementalDetokenizer(runtime.tokenizer, prompt_ids, spec.params.stop,
                                    spec.params.skip_special_tokens),
        eos_token_ids=tuple(runtime.tokenizer.eos_token_ids), index=index,
    )


def fan_out(request: Request, tokenizer, *, shares_prefill: bool = False) -> list[Request]:
    """The n sequences of an n > 1 request, each its own request sharing its handle (sequence i seeded with
    seed + i); the scheduler counts them as one request, finished with the last of them. A ``best_of``
    request fans out into its ``best_of`` candidates, whose outputs the group holds (``ifb.best_of``).

    With ``shares_prefill`` (in-flight batching) they take their seats together and the first prefills the
    prompt for all (``ifb.fork``); otherwise they run one after another.
    """
    params = request.params
    num = params.num_candidates
    best_of = BestOf(params.n, keeps_logprobs=params.logprobs is not None) if num > params.n else None
    group = RequestGroup(num_open=num, best_of=best_of)
    sequences = []
    for i in range(num):
        if best_of is not None:
            sequence_params = candidate_params(params, i)
        else:
            sequence_params = attrs.evolve(params, n=1, **({"seed": params.seed + i} if params.seed is not None else {}))
        spec = attrs.evolve(request.spec, params=sequence_params)
        sequences.append(Request(
            request_id=f"{request.request_id}-{i}", spec=spec, prompt_token_ids=list(request.prompt_token_ids),
            max_tokens=request.max_tokens, handle=request.handle, state=request.state, kv_salt=request.kv_salt,
            num_unsalted_tokens=request.num_unsalted_tokens, num_pinned_tokens=request.num_pinned_tokens,
            detok=IncrementalDetokenizer(tokenizer, request.prompt_token_ids, spec.params.stop,
                                         spec.params.skip_special_tokens),
            eos_token_ids=request.eos_token_ids, arrival_time=request.arrival_time, index=i, group=group,
            founder_only=request.founder_only, runs_alone=request.runs_alone,
            supports_drafts=request.supports_drafts,
        ))
    if shares_prefill:
        group.leader, group.followers = sequences[0], sequences[1:]
    return sequences


class RequestEngine:
    """Serves a runtime: under in-flight batching (``in_flight``), or one request at a time (the blocking path).

    ``reason`` is why a deployment on the blocking path cannot run in flight (None where it only was not asked).
    """

    def __init__(
        self,
        runtime: Runtime,
        config: DeployConfig,
        options: list[RequestOption],
        *,
        in_flight: bool = True,
        prefix: PrefixMatcher | None = None,
        blocks: BlockManager | None = None,
        counters: SchedulingCounters | None = None,
        static_batching: bool = False,
        reason: str | None = None,
    ):
        if in_flight:
            reason = ifb_unsupported_reason(runtime.caps, config)
            if reason is not None:
                raise UnsupportedDeployment(f"cannot enable in-flight batching: {reason}")
        self.is_in_flight = in_flight
        self.reason = reason
        self.runtime = runtime
        self.config = config
        self.options = options
        self.support: dict[str, OptionSupport] = {o.name: runtime.caps.option(o) for o in options}
        num_seats = config.max_batch_size if in_flight else 1
        self.max_in_system = num_seats + config.max_queued_requests
        self.counters = counters or SchedulingCounters()
        self.prefix = prefix
        self.blocks = blocks or pool_for(runtime)
        #: every request is served whole by the runtime (no stepped execution)
        self._serves_whole = not runtime.caps.stepped_execution
        sampling = self.support.get("differing_sampling")
        self.scheduler = Scheduler(
            num_seats=num_seats,
            token_budget=max(config.max_num_batched_tokens, num_seats),
            blocks=self.blocks, tokenizer=runtime.tokenizer, max_model_len=runtime.max_model_len,
            counters=self.counters, static_batching=static_batching, prefix=prefix,
            batch_wide_sampling=in_flight and sampling is not None and sampling.support is not Support.SERVED,
            batch_wide_length=in_flight and runtime.caps.batch_wide_generation_length,
            release=lambda r: runtime.release(r.request_id, r.seat),
            queue_timeout=None if in_flight else config.queue_timeout,
            finish_output=getattr(runtime, "finish_output", None),
            speculation=runtime.caps.speculation if runtime.caps.stepped_execution else None,
        )
        self.scheduler.listeners.append(self)
        self._cv = threading.Condition()
        self._stopping = False
        #: why the runtime cannot go on (``RuntimeLost``), once it happened; the engine has stopped then
        self.lost: BaseException | None = None
        #: called once, from the actor thread, when the runtime is lost (after every request failed)
        self.on_lost: list = []
        self._thread = threading.Thread(target=self._run, name="ifb-engine", daemon=True)
        self._thread.start()

    # ---- submission (any thread) ----
    def check_options(self, spec: RequestSpec) -> tuple[OptionSupport | None, bool]:
        return check_options(self.options, self.support, spec, in_flight=self.is_in_flight)

    def submit(self, spec: RequestSpec, *, wait: bool = False, timeout: float | None = None) -> RequestHandle:
        """Queue a request; returns its handle. Raises InvalidRequest, RequestRejected or EngineFull.

        With ``wait`` the caller blocks until there is room instead of being refused.
        """
        founder, alone = self.check_options(spec)
        request = new_request(self.runtime, spec, on_cancel=self._wake)
        request.founder_only, request.runs_alone = founder, alone
        if request.is_served_whole and self.is_in_flight:
            raise RequestRejected("this request is served whole by its runtime, which only the blocking path does")
        queued: Request | list[Request] = request
        num = spec.params.num_candidates
        if num > 1:
            if num > self.scheduler.num_seats and self.is_in_flight:
                field = "n" if num == spec.params.n else "best_of"
                raise InvalidRequest(
                    f"{field} ({num}) is more than the batch size ({self.scheduler.num_seats}): the {num} "
                    "sequences of a request decode together, one seat each", param=field)
            queued = fan_out(request, self.runtime.tokenizer, shares_prefill=self.is_in_flight)
        with self._cv:
            if self._stopping:
                raise EngineFull("the engine is shutting down")
            if wait:
                if not self._cv.wait_for(lambda: self.counters.in_system < self.max_in_system, timeout):
                    raise EngineFull("timed out waiting for room in the batch and queue")
            if not self.scheduler.submit(queued, self.max_in_system):
                raise EngineFull(
                    f"the engine is full: {self.config.max_batch_size} running + "
                    f"{self.config.max_queued_requests} queued")
            self._cv.notify_all()
        return request.handle

    def is_full(self) -> bool:
        """Whether a submit now would be refused for back-pressure."""
        return self.counters.in_system >= self.max_in_system

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # ---- scheduler listener (actor thread) ----
    def on_token(self, request: Request, now: float) -> None:
        pass

    def on_finish(self, request: Request, now: float) -> None:
        with self._cv:
            self._cv.notify_all()

    # ---- the actor ----
    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self.lost is not None or scheduler.has_work)
                if self._stopping or self.lost is not None:
                    break
            step = scheduler.schedule()
            if step is None:
                continue
            try:
                whole = self._served_whole(step)
                if whole is not None:
                    self._serve_whole(whole)
                else:
                    scheduler.update(step, self.runtime.execute(step))
            except RuntimeLost as exc:
                log.error("the runtime is lost, failing every request: %s", exc)
                self.lost = exc
                break
            except Exception as exc:  # noqa: BLE001 - one step's fault fails that step only
                log.exception("step %d failed", step.step_id)
                scheduler.fail_step(step, exc)
        if self.lost is not None:
            with self._cv:  # no submit slips in between: after this, submit refuses
                scheduler.fail_all(f"the deployment stopped: {self.lost}")
            for callback in list(self.on_lost):
                callback(self.lost)
        scheduler.shutdown()

    def lose(self, error: BaseException) -> None:
        """The runtime was found lost outside a step (a rank died while idle): fail everything and stop."""
        with self._cv:
            if self.lost is None:
                self.lost = error
            self._cv.notify_all()

    def _served_whole(self, step: ScheduledStep) -> Request | None:
        """The request of a one-seat step that the runtime serves whole (``handle_request``), if it is one."""
        if len(step.seqs) != 1:
            return None
        request = self.scheduler.requests.get(step.seqs[0].request_id)
        return request if request is not None and (self._serves_whole or request.is_served_whole) else None

    def _serve_whole(self, request: Request) -> None:
        """Pass on the runtime's outputs for ``request`` as it makes them; then end it with the last."""
        final = None
        for out in self.runtime.handle_request(request.spec, request):
            if out.finished:
                final = out
                break
            request.handle.push(out)
        if final is None:
            reason = "cancelled" if request.handle.cancelled.is_set() else "stop"
            final = RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                                  finish_reason=reason)
        self.scheduler.finish(request, final.finish_reason or "stop", final=final)

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def warmup(self, prompt: str | RequestSpec) -> None:
        """Prefill ``prompt`` and publish its KV before serving (needs the context cache).

        A string is taken as a system prompt and rendered through the chat
        template, so chats that start with it reuse the published blocks.
        """
        if self.prefix is None:
            raise UnsupportedDeployment("a warm-up prompt needs --enable-context-reuse")
        if isinstance(prompt, str):
            text = self.runtime.tokenizer.apply_chat_template(
                [{"role": "system", "content": prompt}], add_generation_prompt=False)
            ids = self.runtime.tokenizer.encode(text, add_special_tokens=False)
            prompt = RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(max_tokens=1, temperature=0.0))
        self.submit(prompt, wait=True).result()

    # ---- reporting ----
    def health(self) -> dict:
        if not self.is_in_flight:
            out = {"in_flight_batching": False, "max_num_seqs": 1}
            if self.scheduler.speculation is not None:
                out["speculative_decoding"] = self.speculation_health()
            return out
        out = {
            "in_flight_batching": True,
            "max_num_seqs": self.config.max_batch_size,
            "scheduling": self.counters.snapshot(),
        }
        if self.scheduler.speculation is not None:
            out["speculative_decoding"] = self.speculation_health()
        if self.blocks.window_groups:  # the KV cache groups: the full-attention pool and each window's
            out["kv_cache"] = {**self.blocks.usage(), "window_groups": [
                {"window": g.window, **g.blocks.usage()} for g in self.blocks.window_groups]}
        if self.prefix is not None:
            c = self.counters
            out["prefix_cache"] = {"queries": c.prefix_cache_queries, "hits": c.prefix_cache_hits,
                                   "evictions": c.prefix_cache_evictions}
        return out

    def speculation_health(self) -> dict:
        """The ``speculative_decoding`` block of ``/health``: the draft source and the counters."""
        caps = self.scheduler.speculation
        return {"method": caps.method, "drafter": caps.description, **self.counters.speculation.snapshot()}
