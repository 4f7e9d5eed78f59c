"""A request's mutable state inside the engine."""

from __future__ import annotations

import enum
import time
from typing import Any

import attrs

from ifb.best_of import BestOf
from ifb.capabilities import OptionSupport
from ifb.detok import IncrementalDetokenizer
from ifb.kv import WindowTable
from ifb.outputs import RequestHandle
from ifb.params import RequestSpec, SamplingParams
from ifb.speculative import DraftStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    request_id: str
    spec: RequestSpec
    prompt_token_ids: list[int]
    max_tokens: int
    handle: RequestHandle
    detok: IncrementalDetokenizer
    #: the runtime's per-request state from ``prepare`` (``Prepared.state``); handed to it in ``NewSeq``
    state: Any = None
    #: ``Prepared.kv_salt``: what besides the tokens makes this request's KV its own
    kv_salt: str | None = None
    #: ``Prepared.num_unsalted_tokens``: the leading tokens whose KV the salt does not change
    num_unsalted_tokens: int = 0
    #: served whole by the runtime's ``handle_request`` (``Prepared.is_served_whole``)
    is_served_whole: bool = False
    #: ``Prepared.num_pinned_tokens``: the prompt prefix the context cache keeps for good
    num_pinned_tokens: int = 0
    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    seat: int | None = None
    block_ids: list[int] = attrs.field(factory=list)
    #: per sliding-window KV group (``BlockManager.window_groups``), its table (as long as ``block_ids``)
    window_tables: list[WindowTable] = attrs.field(factory=list)
    #: the founder-only / runs-alone option this request uses, if any
    founder_only: OptionSupport | None = None
    runs_alone: bool = False
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = attrs.field(factory=time.monotonic)
    admitted_time: float | None = None
    first_token_time: float | None = None
    finish_reason: str | None = None
    index: int = 0
    #: times the request left its seat for lack of KV blocks (it is recomputed when seated again)
    num_preemptions: int = 0
    #: how many of ``block_ids`` the runtime has been sent (the rest go with its next step)
    num_sent_blocks: int = 0
    #: the n > 1 request this is one sequence of (the blocking path fans such a request out)
    group: "RequestGroup | None" = None
    #: ``Prepared.supports_drafts``: drafted tokens may be verified for it
    supports_drafts: bool = True
    #: its drafting record where the deployment speculates (set when it is first seated)
    drafts: DraftStats | None = None
    #: blocks freed from the end of its table that the runtime has not been told of yet
    num_dropped_blocks: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@attrs.define(eq=False)
class RequestGroup:
    """The sequences of one n > 1 request: counted as one request, finished when the last one is."""

    num_open: int
    #: whether one of them has taken a seat (the request's queue time is over)
    is_seated: bool = False
    #: under in-flight batching: the sequence that prefills the shared prompt (``ifb.fork``), else None
    leader: "Request | None" = None
    #: the sequences waiting in their seats to fork from the leader once it has prefilled the prompt
    followers: list["Request"] = attrs.field(factory=list)
    #: a ``best_of`` request's held candidates (None: every sequence is a choice, streamed as it goes)
    best_of: BestOf | None = None
