"""The data the scheduler and a runtime exchange, and the runtime protocol.

The scheduler hands the runtime a frozen ``ScheduledStep``; the runtime returns
a ``StepOutput``. Nothing else crosses: the runtime never sees engine state.
A step carries only what changed (as vLLM V1's scheduler output): a request
taking a seat arrives once as a ``NewSeq`` with its tokens and the state its
``prepare`` made; afterwards each step names only the tokens computed in it and
the blocks added to its table. The runtime keeps the rest per seat
(``SeatTable``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence, runtime_checkable

import attrs

from ifb.capabilities import DeploymentCaps
from ifb.params import RequestSpec, SamplingParams
from ifb.transcription import Transcript

if TYPE_CHECKING:  # the request module imports nothing of this one; the names are for the protocol only
    from ifb.kv import BlockManager
    from ifb.outputs import RequestOutput
    from ifb.request import Request
    from ifb.scheduler import PrefixMatcher


class RuntimeLost(RuntimeError):
    """Raised by ``execute`` when the runtime cannot go on at all (a tensor-parallel rank was lost):
    the engine fails every request it holds and stops, rather than failing one step and going on."""


@attrs.frozen
class NewSeq:
    """A request taking a seat (first seated, or back from preemption): sent once, kept by the runtime."""

    request_id: str
    seat: int
    #: every token known when it was seated: the prompt, plus what it had generated before a preemption
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    params: SamplingParams
    #: what the runtime's ``prepare`` returned as ``Prepared.state`` (the engine never reads it)
    state: Any = None
    #: ``Prepared.kv_salt``: what besides the tokens makes the request's KV its own. The other ranks of a
    #: tensor-parallel deployment never get ``state``; they compute the same KV from this name.
    kv_salt: str | None = None


@attrs.frozen
class WindowBlocks:
    """A request's table in one sliding-window KV group, as far as it changed (``ifb.kv.WindowTable``)."""

    #: the table's leading entries now freed: out of every future query's window, read as the null block
    num_freed: int
    #: blocks appended after the entries the runtime has (after its first ``num_freed`` where it has fewer)
    new_block_ids: tuple[int, ...] = ()


@attrs.frozen
class ScheduledSeq:
    """One request's share of a step: a prefill chunk, one decode token, or a decode token and the
    positions after it that the runtime's drafter fills and the same forward verifies."""

    request_id: str
    seat: int
    token_ids: tuple[int, ...]  # the known tokens computed this step
    start_pos: int  # == the request's num_computed_tokens before this step
    #: blocks appended to the request's block table since the runtime last heard of it
    new_block_ids: tuple[int, ...]
    is_sampling: bool  # this chunk reaches the last known token: sample the next one
    #: positions after ``token_ids`` the runtime may draft and verify this step (their blocks are given)
    num_draft_tokens: int = 0
    #: blocks to drop from the end of the runtime's table before appending ``new_block_ids`` (the engine
    #: freed the blocks that only rejected drafts had used)
    num_dropped_blocks: int = 0
    #: per sliding-window KV group (``Runtime.kv_window_groups``), its table's change; ``num_dropped_blocks``
    #: applies to these tables too (every group's table has one entry per block of the context)
    window_blocks: tuple[WindowBlocks, ...] = ()


@attrs.frozen
class ScheduledStep:
    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    #: requests seated since the last step: their per-seat state starts clean
    new_seqs: tuple[NewSeq, ...] = ()
    #: KV blocks to copy, (source, destination), before the step's forward: the last, partial block of a
    #: prompt that n > 1 sequences share (each writes its own tokens into its copy)
    block_copies: tuple[tuple[int, int], ...] = ()
    #: per sliding-window KV group, its blocks to copy (source, destination), as ``block_copies``
    window_block_copies: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Positions this step may compute: known tokens and the room given for drafts."""
        return sum(len(s.token_ids) + s.num_draft_tokens for s in self.seqs)

    @property
    def reset_seats(self) -> tuple[int, ...]:
        """Seats taken by a new request this step (their per-seat state must start clean)."""
        return tuple(s.seat for s in self.new_seqs)


@attrs.define(eq=False)
class Seat:
    """A runtime's record of one seated request, kept up to date from each step (``SeatTable``)."""

    request_id: str
    seat: int
    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int]  # the prompt and the tokens generated so far, as far as the runtime has seen them
    block_ids: list[int] = attrs.field(factory=list)
    state: Any = None
    #: per sliding-window KV group, its block table (freed entries hold that group's null block)
    window_block_ids: list[list[int]] = attrs.field(factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids


class SeatTable:
    """The per-seat state a runtime keeps from the steps' diffs: token history, block table, prepared state."""

    def __init__(self, null_block_ids: Sequence[int] = ()) -> None:
        """``null_block_ids``: per sliding-window KV group, the block its tables' freed entries name
        (one no sequence writes, so a kernel that read it would read zeros)."""
        self.seats: dict[str, Seat] = {}
        self.null_block_ids = tuple(null_block_ids)

    def apply(self, step: ScheduledStep) -> list[Seat]:
        """Take in the step's new requests and growth; return each of ``step.seqs``' seat, in order."""
        for new in step.new_seqs:
            self.seats[new.request_id] = Seat(new.request_id, new.seat, new.params, new.num_prompt_tokens,
                                              list(new.token_ids), state=new.state,
                                              window_block_ids=[[] for _ in self.null_block_ids])
        out = []
        for seq in step.seqs:
            seat = self.seats[seq.request_id]
            if seq.num_dropped_blocks:
                del seat.block_ids[len(seat.block_ids) - seq.num_dropped_blocks:]
            seat.block_ids.extend(seq.new_block_ids)
            for table, change, null in zip(seat.window_block_ids, seq.window_blocks, self.null_block_ids):
                if seq.num_dropped_blocks:
                    del table[len(table) - seq.num_dropped_blocks:]
                i = min(change.num_freed, len(table)) - 1
                while i >= 0 and table[i] != null:  # the entries freed since the last step
                    table[i] = null
                    i -= 1
                table.extend([null] * (change.num_freed - len(table)))
                table.extend(change.new_block_ids)
            known = len(seat.token_ids) - seq.start_pos
            if known < len(seq.token_ids):  # a decode token the runtime sampled itself: now in the history
                seat.token_ids.extend(seq.token_ids[max(known, 0):])
            out.append(seat)
        return out

    def accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Drafted tokens the step verified: they are in the seat's history now (the engine's next step
        starts after them)."""
        self.seats[request_id].token_ids.extend(token_ids)

    def release(self, request_id: str) -> None:
        self.seats.pop(request_id, None)


@attrs.frozen
class SampledToken:
    """A token a step produced, with its logprobs where the request asked for them."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class SeqOutput:
    """One sequence's result of a step.

    ``token_id`` is None while a prompt is still being prefilled; on a sampling
    sequence, None means the runtime finished no token this step (a canvas
    still being denoised): the request is scheduled again.
    ``more_token_ids`` follow ``token_id`` when a step finishes several at once
    (a whole block); they carry no logprobs.
    """

    request_id: str
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    #: drafted tokens the step verified, in order, before ``token_id`` (the target's own next token)
    accepted: tuple[SampledToken, ...] = ()
    #: drafted tokens the step verified, accepted or not
    num_drafted: int = 0
    #: why drafting failed for this request (it goes on without drafts); None: it did not
    speculation_error: str | None = None
    more_token_ids: tuple[int, ...] = ()


@attrs.frozen
class StepOutput:
    seqs: tuple[SeqOutput, ...]


@attrs.frozen
class Prepared:
    """A request after tokenization (and media encoding), ready to be queued."""

    prompt_token_ids: tuple[int, ...]
    #: the runtime's own per-request state (a typed object of its choosing); it comes back in ``NewSeq.state``
    state: Any = attrs.field(default=None, eq=False)
    #: what besides the tokens makes this request's KV its own (media, an adapter): the context cache keys
    #: its blocks by it, so equal token ids under another salt never share KV
    kv_salt: str | None = None
    #: the leading prompt tokens whose KV the salt does not change (the text before a prompt's first media
    #: item): the context cache keys the blocks that lie wholly within them by their tokens alone
    num_unsalted_tokens: int = 0
    #: the runtime serves this request whole, itself (``handle_request``), not step by step; only where
    #: requests run one at a time (the blocking path)
    is_served_whole: bool = False
    #: drafted tokens may be verified for this request (False: a grammar-constrained one, say, whose
    #: matcher advances one sampled token at a time)
    supports_drafts: bool = True
    #: keep the KV of the prompt's first N tokens in the context cache, never evicted (the legacy system-prompt
    #: capture under in-flight batching): published when the step that computed them ends, then leased by others
    num_pinned_tokens: int = 0


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


class Runtime(Protocol):
    """What a plugin's ``load`` returns: exactly what the engine calls and reads.

    ``RequestEngine`` calls ``prepare`` from submitting threads, and everything
    else from its one actor thread: ``execute`` once per step and ``release``
    when a request leaves its seat. On the blocking path (one seat) it is the
    same engine; a runtime without stepped execution (``caps.stepped_execution``
    false), and a request whose ``Prepared.is_served_whole`` is set, is served
    through ``handle_request`` in that seat instead of ``execute``.
    ``num_kv_blocks`` and ``kv_block_size`` size the engine's block bookkeeping
    (the runtime owns the tensors) and bound the prompt a request may bring.
    A runtime whose sliding-window layers keep only their window of KV also
    declares ``kv_window_groups`` (``ifb.kv.WindowGroupSpec``, optional): each
    such group has its own pool and per-request table (``Seat.window_block_ids``,
    kept from ``ScheduledSeq.window_blocks``), and ``num_kv_blocks`` is then the
    full-attention layers' pool.
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

        ``step.new_seqs`` are requests seated since the last step (their seats'
        state must start clean); a request back from preemption arrives there
        again with every token it had, and is recomputed from position 0.
        """

    def release(self, request_id: str, seat: int) -> None:
        """A request left its seat: finished, cancelled, failed or preempted (it may come back)."""

    def blocking_prefix(self, blocks: BlockManager) -> PrefixMatcher:
        """Optional: the runtime's own prefix reuse on the blocking path, over the engine's ``blocks``
        (the legacy system-prompt capture); asked once, when the deployment is built."""

    def finish_output(self, request: Request, output: RequestOutput) -> Sequence[RequestOutput]:
        """Optional: the outputs that replace a request's final one (the answer spoken).

        Called on the actor thread when a request finishes with ``stop`` or
        ``length``; the last output returned must be ``finished``.
        """

    def read_transcript(self, text: str, is_final: bool) -> Transcript:
        """Optional: a transcription request's output text read as a transcript (without the header
        the model writes first, e.g. the language it heard); ``is_final`` false while the output
        grows, when a header that may still be coming reads as no text yet. Without it the output
        is the transcript."""

    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[RequestOutput]:
        """Serve one request whole, alone in its seat; yield its outputs, the last ``finished``.

        For runtimes without stepped execution, and requests prepared with
        ``is_served_whole``. ``request`` is the engine's ``Request`` built from
        ``spec`` and this runtime's ``prepare`` (``request.state`` is the
        prepared state); check ``request.handle.cancelled`` between outputs.
        """
