"""The data the scheduler and a runtime exchange, and the runtime protocol.

The scheduler hands the runtime a frozen ``ScheduledStep``; the runtime returns
a ``StepOutput``. Nothing else crosses: the runtime never sees engine state.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable

import attrs

from ifb.capabilities import DeploymentCaps
from ifb.params import RequestSpec, SamplingParams


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
    request_id: str
    token_id: int | None  # None while a prompt is still being prefilled
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


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
    """What a plugin's ``load`` returns.

    A stepped runtime implements ``execute``; every runtime implements
    ``handle_request`` (the blocking path: one request, start to finish).
    """

    model_name: str
    caps: DeploymentCaps
    tokenizer: Tokenizer
    max_model_len: int
    kv_block_size: int
    num_kv_blocks: int

    def prepare(self, spec: RequestSpec) -> Prepared:
        """Tokenize (render chat, encode media); raise InvalidRequest on bad input."""

    def execute(self, step: ScheduledStep) -> StepOutput:
        """Run one forward over the step's tokens and sample where asked."""

    def release(self, request_id: str, seat: int) -> None:
        """A request left its seat (finished, cancelled or failed)."""

    def handle_request(self, spec: RequestSpec, prepared: Prepared) -> Iterator[Any]:
        """Serve one request alone; yields ``RequestOutput`` objects."""
