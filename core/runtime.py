"""The data the scheduler and a runtime exchange, and the runtime protocol.

The scheduler hands the runtime a frozen ``ScheduledStep``; the runtime returns
a ``StepOutput``. Nothing else crosses: the runtime never sees engine state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol, runtime_checkable

import attrs

from ifb.capabilities import DeploymentCaps
from ifb.params import RequestSpec, SamplingParams

if TYPE_CHECKING:  # the request module imports nothing of this one; the names are for the protocol only
    from ifb.blocking import AlonePlan
    from ifb.outputs import RequestOutput
    from ifb.request import Request


@attrs.frozen
class ScheduledSeq:
    """One request's share of a step: a prefill chunk or one decode token."""

    request_id: str
    seat: int
    token_ids: tuple[int, ...]  # the tokens computed this step
    start_pos: int  # == the request's num_computed_tokens before this step
    block_ids: tuple[int, ...]  # the request's whole block table
    is_sampling: bool  # this chunk reaches the last known token: sample the next one
    params: SamplingParams
    num_prompt_tokens: int
    all_token_ids: tuple[int, ...]  # prompt + generated so far (penalties, seeds)
    extras: dict[str, Any] = attrs.field(factory=dict, hash=False)  # prepared media, etc.


@attrs.frozen
class ScheduledStep:
    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    #: seats taken by a new request this step: per-seat state must start clean
    reset_seats: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@attrs.frozen
class SeqOutput:
    """One sequence's result of a step.

    ``token_id`` is None while a prompt is still being prefilled; on a sampling
    sequence, None means the runtime finished no token this step (a
    block-diffusion canvas still denoising): the request is scheduled again.
    ``more_token_ids`` follow ``token_id`` when a step finishes several at once
    (a whole block); they carry no logprobs.
    """

    request_id: str
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    more_token_ids: tuple[int, ...] = ()


@attrs.frozen
class StepOutput:
    seqs: tuple[SeqOutput, ...]


@attrs.frozen
class Prepared:
    """A request after tokenization (and media encoding), ready to be queued."""

    prompt_token_ids: tuple[int, ...]
    extras: dict[str, Any] = attrs.field(factory=dict, hash=False)


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


class Runtime(Protocol):
    """What a plugin's ``load`` returns: exactly what the engines call and read.

    ``RequestEngine`` (in-flight batching) calls ``prepare`` from submitting
    threads and ``execute`` and ``release`` from its one actor thread;
    ``BlockingEngine`` calls ``prepare`` from submitting threads and then, from
    its worker thread, one request at a time: ``handle_request`` where the
    runtime has one (a runtime without stepped execution,
    ``caps.stepped_execution`` false), else the optional ``plan_alone`` and
    then ``execute`` and ``release`` (``ifb.blocking.serve_alone``). A
    runtime without stepped execution needs no ``execute``; its ``release`` is
    never called. Both engines read the attributes below; ``num_kv_blocks``
    and ``kv_block_size`` size the engine's block bookkeeping (the runtime
    owns the tensors) and bound the prompt a request may bring.
    """

    model_name: str
    caps: DeploymentCaps
    tokenizer: Tokenizer
    max_model_len: int
    kv_block_size: int
    num_kv_blocks: int

    def prepare(self, spec: RequestSpec) -> Prepared:
        """Tokenize (render chat, encode media); raise InvalidRequest on bad input. Any thread."""

    def execute(self, step: ScheduledStep) -> StepOutput:
        """Run one forward over the step's tokens and sample where ``is_sampling`` asks.

        ``step.reset_seats`` name seats whose per-seat state must start clean;
        a sequence's ``start_pos`` may go back to 0 for a request that was
        preempted and is being recomputed.
        """

    def release(self, request_id: str, seat: int) -> None:
        """A request left its seat: finished, cancelled, failed or preempted (it may come back)."""

    def plan_alone(self, request: Request) -> AlonePlan:
        """Optional, stepped runtimes: what serving ``request`` alone on the blocking path adds.

        Called once per request before its first step; it runs no step of its own
        (it may compute a prefix's KV, as a system-prompt capture does). Without it
        the request is served with ``AlonePlan()``: a fresh pool, nothing added.
        """

    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[RequestOutput]:
        """Runtimes without stepped execution: serve one request alone; yield its outputs, the last ``finished``.

        ``request`` is the engine's ``Request`` built from ``spec`` and this
        runtime's ``prepare``: its ``prompt_token_ids`` and ``extras`` are the
        prepared ones. A stepped runtime leaves it out (``plan_alone`` says what it adds).
        """
