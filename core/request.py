"""A request's mutable state inside the engine."""

from __future__ import annotations

import enum
import time

import attrs

from ifb.capabilities import OptionSupport
from ifb.detok import IncrementalDetokenizer
from ifb.outputs import RequestHandle
from ifb.params import RequestSpec, SamplingParams


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
    extras: dict = attrs.field(factory=dict)
    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    seat: int | None = None
    block_ids: list[int] = attrs.field(factory=list)
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
