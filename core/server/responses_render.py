"""Engine outputs -> Responses API objects and its typed stream events.

A response's ``output`` holds, in order: a ``reasoning`` item (the thinking,
as ``reasoning_text`` content) when the model thought, a ``message`` item
with one ``output_text`` part when it answered in text, and one
``function_call`` item per tool call. The stream opens each item when its
first text arrives and closes it when the next begins or the answer ends,
with the events the official client parses (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed``, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable

from ifb.outputs import RequestOutput
from ifb.params import ThinkingBlock
from ifb.server.answer import AnswerStream, whole
from ifb.server.errors import ApiError
from ifb.server.render import Collected, Sequence
from ifb.server.tools import ToolCall, ToolPlan


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments, "status": status}


class ResponsesRenderer:
    """One request's response object and stream events; ``envelope`` holds the request's echoed settings.

    ``on_done(response)`` is called with the finished response object (the store keeps it).
    """

    done_marker = None  # the Responses stream ends with response.completed, not [DONE]
    include_usage = False

    def __init__(self, envelope: dict[str, Any], *, tools: ToolPlan | None, thinking: ThinkingBlock | None,
                 on_done: Callable[[dict[str, Any]], None] | None = None):
        self.envelope = envelope
        self.tools = tools
        self.thinking = thinking
        self.on_done = on_done
        self._answer = AnswerStream(tools, thinking)
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # finished output items
        self._open: dict[str, Any] | None = None  # the item being streamed, and its text so far
        self._open_text = ""

    # ---- the response object ----
    def response(self, status: str, output: list[dict[str, Any]], collected: Collected | None,
                 reason: str | None = None) -> dict[str, Any]:
        body = {**self.envelope, "status": status, "output": output, "usage": None,
                "incomplete_details": None, "error": None}
        if collected is not None:
            usage = collected.usage()
            body["usage"] = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": usage["completion_tokens"],
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"]}
        if reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def full(self, collected: Collected) -> dict[str, Any]:
        seq = collected.seqs[0]
        answer = whole("".join(seq.texts), self.tools, self.thinking)
        output = []
        if answer.thinking:
            output.append(reasoning_item(answer.thinking))
        if answer.text or not answer.calls:
            output.append(message_item(answer.text or ""))
        output.extend(call_item(c) for c in answer.calls)
        return self._finished(self.response("completed", output, collected, seq.finish_reason))

    def _finished(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.on_done is not None:
            self.on_done(body)
        return body

    # ---- the stream ----
    def _event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return kind, event

    def opening(self) -> list[tuple[str, dict[str, Any]]]:
        shell = self.response("in_progress", [], None)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def _index(self) -> int:
        return len(self._items)

    def _start(self, item_type: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        item = reasoning_item("", status="in_progress") if item_type == "reasoning" else \
            message_item("", status="in_progress")
        if item_type == "reasoning":
            item["content"] = []
        self._open, self._open_text = item, ""
        events.append(self._event("response.output_item.added", output_index=self._index(), item=dict(item)))
        part = {"type": "reasoning_text", "text": ""} if item_type == "reasoning" else _text_part("")
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                  content_index=0, part=part))
        return events

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, text = self._open, self._open_text
        if item is None:
            return []
        self._open = None
        where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        if item["type"] == "reasoning":
            done = reasoning_item(text, item["id"])
            part = {"type": "reasoning_text", "text": text}
            events = [self._event("response.reasoning_text.done", **where, text=text)]
        else:
            done = message_item(text, item["id"])
            part = _text_part(text)
            events = [self._event("response.output_text.done", **where, text=text, logprobs=[])]
        events.append(self._event("response.content_part.done", **where, part=part))
        events.append(self._event("response.output_item.done", output_index=self._index(), item=done))
        self._items.append(done)
        return events

    def _text(self, item_type: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = [] if self._open is not None and self._open["type"] == item_type else self._start(item_type)
        self._open_text += text
        where = {"item_id": self._open["id"], "output_index": self._index(), "content_index": 0}
        if item_type == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        else:
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return events

    def _call(self, call: ToolCall) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        index, item = self._index(), call_item(call)
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=call_item(call, status="in_progress", arguments="")))
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=call.arguments))
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=call.name, arguments=call.arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self._items.append(item)
        return events

    def delta(self, out: RequestOutput, seq: Sequence) -> list[tuple[str, dict[str, Any]]]:
        piece = self._answer.feed(out.text, out.finished)
        events = [*self._text("reasoning", piece.thinking), *self._text("message", piece.text)]
        for call in piece.calls:
            events.extend(self._call(call))
        if out.finished:
            if not self._items and self._open is None:  # an empty answer is still a message
                events.extend(self._start("message"))
            events.extend(self._close())
        return events

    def closing(self, collected: Collected) -> list[tuple[str, dict[str, Any]]]:
        body = self.response("completed", list(self._items), collected, collected.seqs[0].finish_reason)
        # response.completed even when the status is incomplete: the official client's stream helper
        # takes its final response from that event only
        return [self._event("response.completed", response=self._finished(body))]

    def error_event(self, error: ApiError) -> tuple[str, dict[str, Any]]:
        return self._event("error", code=error.code, message=error.message, param=error.param)


def envelope(response_id: str, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The fields every response object of a request repeats."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model, **settings}
