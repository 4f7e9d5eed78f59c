"""Guided decoding: ``response_format`` -> an llguidance grammar -> a token mask per sampling step.

A request's ``extras["response_format"]`` takes one of these forms:

* ``{"type": "text"}`` (or absent): unguided;
* ``{"type": "json_object"}``: any JSON object (OpenAI);
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``:
  a JSON value that validates against ``schema`` (OpenAI; always enforced, whatever ``strict`` says);
* ``{"type": "regex", "regex": "..."}``: text that the whole regex matches (an extension);
* ``{"type": "grammar", "grammar": "..."}``: text of a context-free grammar in Lark syntax with a
  ``start`` rule, or llama.cpp's GBNF with a ``root`` rule (an extension).

``compile`` turns a format into a validated grammar at submit time, so a bad schema,
regex or grammar is an ``InvalidRequest`` naming the library's reason. The runtime keeps
one matcher per request, so guided and unguided rows share a step and each matcher
advances on its own row: ``prefetch`` starts computing the step's masks (all guided rows
at once, llguidance's executor, off the GIL) on a worker thread while the forward runs;
``mask_logits`` sets the logits of tokens each row's grammar forbids to -inf, and
``advance`` feeds the sampled token to the matcher. Once the grammar is complete and
nothing but the end may follow, only EOS is left.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import Any, Sequence

import attrs
import llguidance
import numpy as np
import torch

from ifb.params import InvalidRequest, ThinkingBlock
from ifb.runtime import Seat
from ifb_plugins.common.chat.tokenizer import TextTokenizer

__all__ = ["GuidedDecoder", "GuidedGrammar", "GuidedStats", "grammar_for"]


#: JSON is generated in one fixed layout (``{"a": 1, "b": [2, 3]}``): free whitespace lets a
#: small model wander into endless blank lines instead of closing the object
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_KINDS = ("text", "json_object", "json_schema", "regex", "grammar")


@attrs.frozen
class GuidedGrammar:
    """A validated grammar, ready to build matchers from (it crosses in the runtime's prepared state)."""

    kind: str  # json_object | json_schema | regex | grammar
    grammar: str  # llguidance's serialized grammar


@attrs.define
class GuidedStats:
    """Time spent on guided rows, for reporting: masks computed and applied, tokens consumed."""

    num_tokens: int = 0
    mask_ns: int = 0
    advance_ns: int = 0

    @property
    def us_per_token(self) -> float:
        return (self.mask_ns + self.advance_ns) / max(1, self.num_tokens) / 1e3


@attrs.define
class _Matcher:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0


def _text_field(fmt: dict, name: str) -> str:
    value = fmt.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"response_format of type {fmt['type']} needs a non-empty string {name!r}")
    return value


def _json_schema_of(fmt: dict) -> Any:
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format of type json_schema needs a json_schema object")
    schema = spec.get("schema", {})  # OpenAI: no schema means any JSON value
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON Schema object")
    return schema


def grammar_for(response_format: Any) -> GuidedGrammar | None:
    """Translate a ``response_format`` into an (unvalidated) grammar; None when it is unguided."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidRequest("response_format must be an object with a type")
    kind = response_format["type"]
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_LAYOUT)
        elif kind == "json_schema":
            text = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(_json_schema_of(response_format)), defaults=_JSON_LAYOUT)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(_text_field(response_format, "regex"))
        elif kind == "grammar":
            text = llguidance.grammar_from("grammar", _text_field(response_format, "grammar"))
        else:
            raise InvalidRequest(f"unknown response_format type {kind!r} ({', '.join(_KINDS)})")
    except InvalidRequest:
        raise
    except (ValueError, TypeError) as exc:  # the library's own reason, e.g. a schema that is not JSON
        raise InvalidRequest(f"invalid response_format ({kind}): {exc}") from exc
    return GuidedGrammar(kind=kind, grammar=text)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a Lark string literal


def after_thinking(grammar: GuidedGrammar, block: ThinkingBlock) -> GuidedGrammar:
    """``grammar`` behind a thinking block: free text up to the block's end, then the grammar.

    The block is optional unless the prompt opened it (``block.is_open``); the
    whitespace a model writes after the block's end is allowed. The inner
    grammar is referenced, not rewritten, so every kind (JSON Schema, regex,
    Lark, GBNF) is wrapped the same way.
    """
    try:
        inner = json.loads(grammar.grammar)
        grammars = list(inner["grammars"])
    except (ValueError, KeyError, TypeError):  # Lark text as the library took it
        grammars = [{"name": "answer", "lark_grammar": grammar.grammar}]
    grammars[0] = {**grammars[0], "name": "answer"}
    # the rule ends at the first end tag the model writes (``stop``), whatever came before it
    think = f"thought[stop={_lark_string(block.end)}]: /(.|\\n)*/"
    opening = "thought" if block.is_open else f"({_lark_string(block.start)} thought)?"
    outer = f"start: {opening} /[ \\t\\r\\n]*/ @answer\n{think}\n"
    wrapped = {"grammars": [{"name": "start", "lark_grammar": outer}, *grammars]}
    return GuidedGrammar(kind=grammar.kind, grammar=json.dumps(wrapped))


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: every token's raw bytes, the special ids, encode."""

    def __init__(self, tokenizer: TextTokenizer, num_tokens: int):
        self._tokenizer = tokenizer
        known = tokenizer.vocab_size
        # Ids past the tokenizer's vocabulary (a model's padded output rows) stand for no bytes,
        # so the grammar never allows them.
        self.tokens = [self._bytes_of(i) if i < known else b"" for i in range(num_tokens)]
        added = tokenizer.tokenizer.get_added_tokens_decoder()
        self.special_token_ids = sorted(i for i, token in added.items() if token.special and i < num_tokens)
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id

    def _bytes_of(self, token_id: int) -> bytes:
        try:
            return self._tokenizer.token_to_bytes(token_id)
        except KeyError:  # a byte-level vocabulary entry outside the byte alphabet: take its text
            return (self._tokenizer.id_to_token(token_id) or "").encode("utf-8")

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GuidedDecoder:
    """The text runtime's guided decoding: grammars at submit time, matchers while generating.

    ``compile`` may run on any thread; ``mask_logits``, ``advance`` and ``release`` run on the
    thread that executes steps.
    """

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the width of the model's logits
        self.matchers: dict[str, _Matcher] = {}
        self.stats = GuidedStats()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        #: computes a step's masks while the forward runs (None: on the executing thread, after it)
        self.is_overlapped = True
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        #: the masks ``prefetch`` is computing: request id -> row of the bitmask batch
        self._pending: tuple[concurrent.futures.Future, dict[str, int]] | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it, built on first use (a pass over the vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if not self.tokenizer.eos_token_ids:
                    raise InvalidRequest("guided decoding needs a model with an end-of-sequence token")
                num_tokens = max(self.vocab_size, self.tokenizer.vocab_size)
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer, num_tokens))
                self._ll_tokenizer = llguidance.LLTokenizer(
                    wrapper, n_vocab=num_tokens, eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, response_format: Any, after: ThinkingBlock | None = None) -> GuidedGrammar | None:
        """Validate ``response_format`` against this vocabulary; raise InvalidRequest with the reason.

        ``after``: the thinking block the answer may start with; the grammar applies after it.
        """
        grammar = grammar_for(response_format)
        if grammar is None:
            return None
        if after is not None:
            grammar = after_thinking(grammar, after)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar.grammar, self.ll_tokenizer)
        if is_error:
            reason = messages[0].strip() if messages else "the grammar is invalid"
            raise InvalidRequest(f"invalid response_format ({grammar.kind}): {reason}")
        return grammar

    # ---- per step (the executing thread) ----
    @staticmethod
    def applies_to(seat: Seat) -> bool:
        """Whether ``seat``'s request decodes under a grammar (its prepared state's ``grammar``, compiled at
        admission)."""
        return getattr(seat.state, "grammar", None) is not None

    def prefetch(self, seats: Sequence[Seat]) -> None:
        """Start computing the next-token masks of ``seats`` (those that sample this step) that decode
        under a grammar; ``mask_logits`` takes them. The history each matcher follows is known before
        the forward, so the masks need not wait for it."""
        guided = [seat for seat in seats if self.applies_to(seat)]
        if not guided:
            return
        rows = {seat.request_id: i for i, seat in enumerate(guided)}
        if not self.is_overlapped:
            self._pending = (_done(self._compute(guided)), rows)
            return
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ifb-guided")
        self._pending = (self._worker.submit(self._compute, guided), rows)

    def discard(self) -> None:
        """Drop masks the step did not use (it failed): wait for them, so no matcher is touched later."""
        pending, self._pending = self._pending, None
        if pending is not None:
            concurrent.futures.wait([pending[0]])

    def _compute(self, seats: Sequence[Seat]) -> np.ndarray:
        """The bitmasks ``[len(seats), words]`` of the tokens each seat's grammar allows next."""
        start = time.perf_counter_ns()
        words = (self.ll_tokenizer.vocab_size + 31) // 32
        bitmask = np.zeros((len(seats), words), dtype=np.int32)
        live = []
        for i, seat in enumerate(seats):
            state = self._matcher_for(seat)
            if state.matcher.is_stopped():
                self._allow_only_eos(bitmask[i])  # complete: nothing but the end may follow
            else:
                live.append((state.matcher, i))
        if len(live) == 1:
            matcher, i = live[0]
            matcher.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, bitmask[i].nbytes)
        elif live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(live, bitmask.ctypes.data, bitmask[0].nbytes, len(seats))
        self.stats.mask_ns += time.perf_counter_ns() - start
        return bitmask

    def mask_logits(self, logits: torch.Tensor, rows: Sequence[tuple[int, Seat]]) -> None:
        """Set to -inf, in place, the logits each guided row's grammar forbids next.

        ``rows`` pairs a row of ``logits`` with the sequence it samples for; their masks are the ones
        ``prefetch`` started (computed now for rows it did not cover).
        """
        pending, self._pending = self._pending, None
        bitmask, index = (pending[0].result(), pending[1]) if pending is not None else (None, {})
        missing = [seat for _, seat in rows if seat.request_id not in index]
        if missing:
            bitmask, index = self._compute([seat for _, seat in rows]), {s.request_id: i for i, (_, s) in enumerate(rows)}
        start = time.perf_counter_ns()
        for row, seat in rows:
            _forbid(logits[row], bitmask[index[seat.request_id]])
        self.stats.mask_ns += time.perf_counter_ns() - start

    def mask_drafted(self, logits: torch.Tensor, seat: Seat, drafts: Sequence[int]) -> int:
        """For a guided seat verifying ``drafts`` on its ``len(drafts) + 1`` rows of ``logits``: how many
        leading drafts its grammar allows (``n``), with rows ``0..n`` masked in place, row ``j`` by what the
        grammar allows after the first ``j`` drafts. A draft the grammar forbids could never be accepted
        (its row's mask removes it), so the rows past it are left alone and the caller verifies only the
        first ``n``. The matcher ends where it started: ``advance`` feeds it what the verification emits.
        The seat must not be in a pending ``prefetch``."""
        start = time.perf_counter_ns()
        matcher = self._matcher_for(seat).matcher
        n = 0 if matcher.is_stopped() else matcher.validate_tokens(list(drafts))
        bitmask = np.zeros((n + 1, (self.ll_tokenizer.vocab_size + 31) // 32), dtype=np.int32)
        consumed = 0
        try:
            for j in range(n + 1):
                if matcher.is_stopped():
                    self._allow_only_eos(bitmask[j])
                else:
                    matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, bitmask[j].nbytes)
                if j < n:
                    if not matcher.consume_token(drafts[j]):
                        raise RuntimeError(f"guided decoding lost track of the grammar: {matcher.get_error()}")
                    consumed += 1
        finally:
            if consumed:
                matcher.rollback(consumed)
        for j in range(n + 1):
            _forbid(logits[j], bitmask[j])
        self.stats.mask_ns += time.perf_counter_ns() - start
        return n

    def _allow_only_eos(self, bits: np.ndarray) -> None:
        for eos in self.tokenizer.eos_token_ids:
            bits.view(np.uint32)[eos // 32] |= np.uint32(1 << (eos % 32))

    def advance(self, rows: Sequence[tuple[Seat, int]]) -> None:
        """Feed each guided sequence's sampled token to its matcher."""
        start = time.perf_counter_ns()
        for seq, token_id in rows:
            state = self.matchers[seq.request_id]
            if state.matcher.is_stopped():
                continue  # the forced EOS (or tokens after it, with ignore_eos) leaves the grammar done
            if not state.matcher.consume_token(token_id):
                raise RuntimeError(f"guided decoding lost track of the grammar: {state.matcher.get_error()}")
            state.num_consumed += 1
        self.stats.num_tokens += len(rows)
        self.stats.advance_ns += time.perf_counter_ns() - start

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def _matcher_for(self, seq: Seat) -> _Matcher:
        state = self.matchers.get(seq.request_id)
        if state is None:
            grammar: GuidedGrammar = seq.state.grammar
            matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar.grammar, log_level=0)
            if matcher.is_error():
                raise RuntimeError(f"guided decoding could not start: {matcher.get_error()}")
            state = self.matchers[seq.request_id] = _Matcher(matcher)
        # The matcher follows the sequence's own history (the scheduler's record of its output).
        generated = seq.all_token_ids[seq.num_prompt_tokens:]
        for token_id in generated[state.num_consumed:]:
            if state.matcher.is_stopped():
                break
            if not state.matcher.consume_token(token_id):
                raise RuntimeError(f"guided decoding lost track of the grammar: {state.matcher.get_error()}")
            state.num_consumed += 1
        return state


def _forbid(row: torch.Tensor, bits: np.ndarray) -> None:
    """Set to -inf, in place, the logits of ``row [V]`` whose bit in ``bits`` (one per token, least
    significant first) is clear."""
    forbidden = np.unpackbits(~bits.view(np.uint8), count=row.shape[0], bitorder="little").view(np.bool_)
    if row.device.type == "cpu" and row.dtype == torch.float32:
        # numpy masks in one thread: torch's parallel masked_fill_ stalls on a busy CPU
        np.copyto(row.numpy(), -np.inf, where=forbidden)
    else:
        row.masked_fill_(torch.from_numpy(forbidden).to(row.device), float("-inf"))


def _done(value) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future
