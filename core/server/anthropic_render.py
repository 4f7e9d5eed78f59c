"""Engine outputs -> Anthropic Messages API messages and its stream events.

A message's ``content`` holds, in order: a ``thinking`` block when the model
thought, a ``text`` block when it answered in text, and one ``tool_use``
block per tool call. The stream sends ``message_start``, then per block
``content_block_start``, its deltas (``thinking_delta``, ``text_delta``,
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (the
stop reason and usage) and ``message_stop``, each with its ``event:`` name, as
the ``anthropic`` SDK reads them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from ifb.outputs import RequestOutput
from ifb.params import ThinkingBlock
from ifb.server.answer import AnswerStream, whole
from ifb.server.errors import ApiError
from ifb.server.render import Collected, Sequence
from ifb.server.tools import ToolCall, ToolPlan


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": json.loads(call.arguments)}


def stop_reason(seq: Sequence, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished sequence."""
    if seq.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if seq.stop_string is not None:
        return "stop_sequence", seq.stop_string
    return "end_turn", None


class MessagesRenderer:
    """One request's message and stream events."""

    done_marker = None
    include_usage = False

    def __init__(self, message_id: str, model: str, *, tools: ToolPlan | None, thinking: ThinkingBlock | None):
        self.message_id = message_id
        self.model = model
        self.tools = tools
        self.thinking = thinking
        self._answer = AnswerStream(tools, thinking)
        self._started = False
        self._index = -1  # the open block's index
        self._open: str | None = None  # its type
        self._has_calls = False

    def _shell(self, content: list[dict[str, Any]], input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    def full(self, collected: Collected) -> dict[str, Any]:
        seq = collected.seqs[0]
        answer = whole("".join(seq.texts), self.tools, self.thinking)
        content: list[dict[str, Any]] = []
        if answer.thinking:
            content.append({"type": "thinking", "thinking": answer.thinking, "signature": ""})
        if answer.text or not answer.calls:
            content.append({"type": "text", "text": answer.text or ""})
        content.extend(tool_use(c) for c in answer.calls)
        usage = collected.usage()
        body = self._shell(content, usage["prompt_tokens"], usage["completion_tokens"])
        body["stop_reason"], body["stop_sequence"] = stop_reason(seq, bool(answer.calls))
        return body

    # ---- the stream ----
    def opening(self) -> list[tuple[str, dict[str, Any]]]:
        return []  # message_start waits for the first output: it carries the prompt's token count

    def _start(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self._stop()
        self._index += 1
        self._open = kind
        events.append(("content_block_start", {"type": "content_block_start", "index": self._index,
                                               "content_block": block}))
        return events

    def _stop(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":  # the SDK expects a signature on a thinking block; ours is empty
            events.append(("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                   "delta": {"type": "signature_delta", "signature": ""}}))
        self._open = None
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        return events

    def _delta(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = []
        if self._open != kind:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events = self._start(kind, block)
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}))
        return events

    def delta(self, out: RequestOutput, seq: Sequence) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if not self._started:
            self._started = True
            events.append(("message_start", {"type": "message_start",
                                             "message": self._shell([], out.num_prompt_tokens, 1)}))
        piece = self._answer.feed(out.text, out.finished)
        events += self._delta("thinking", piece.thinking) + self._delta("text", piece.text)
        for call in piece.calls:
            self._has_calls = True
            events += self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                                               "input": {}})
            events.append(("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": call.arguments}}))
        if out.finished:
            if self._index == -1:  # an empty answer is still one text block
                events += self._start("text", {"type": "text", "text": ""})
            events += self._stop()
        return events

    def closing(self, collected: Collected) -> list[tuple[str, dict[str, Any]]]:
        seq = collected.seqs[0]
        reason, sequence = stop_reason(seq, self._has_calls)
        return [("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": collected.usage()["completion_tokens"]}}),
                ("message_stop", {"type": "message_stop"})]

    def error_event(self, error: ApiError) -> tuple[str, dict[str, Any]]:
        return "error", error.anthropic_body()


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
