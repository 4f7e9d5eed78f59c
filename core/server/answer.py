"""One generated answer as typed pieces: thinking, answer text, tool calls.

Chat completions, the Responses API and the Messages API render the same
pieces in their own shapes; this is where a sequence's text is split once:
the thinking block first (``reasoning``), then tool calls out of the answer
(``tools``).
"""

from __future__ import annotations

import attrs

from ifb.params import ThinkingBlock
from ifb.server.reasoning import ReasoningSplitter
from ifb.server.reasoning import split as split_thinking
from ifb.server.tools import ToolCall, ToolPlan, ToolStream, parse


@attrs.frozen
class Piece:
    """What one output adds: thinking text, answer text, and (at the end) the tool calls."""

    thinking: str = ""
    text: str = ""
    calls: tuple[ToolCall, ...] = ()


class AnswerStream:
    """Splits one sequence's streamed text; ``feed`` each output's text, the last with ``finished``."""

    def __init__(self, tools: ToolPlan | None, thinking: ThinkingBlock | None):
        self._splitter = ReasoningSplitter(thinking) if thinking is not None else None
        self._tools = ToolStream(tools.fmt) if tools is not None else None

    def feed(self, text: str, finished: bool) -> Piece:
        thought = ""
        if self._splitter is not None:
            thought, text = self._splitter.feed(text)
            if finished:
                more_thought, more_text = self._splitter.finish()
                thought, text = thought + more_thought, text + more_text
        calls: list[ToolCall] = []
        if self._tools is not None:
            text = self._tools.feed(text)
            if finished:
                rest, calls = self._tools.finish()
                text += rest
        return Piece(thought, text, tuple(calls))


@attrs.frozen
class Answer:
    """A whole sequence's answer: thinking (None: there was no block), text (None: only calls), calls."""

    thinking: str | None
    text: str | None
    calls: tuple[ToolCall, ...] = ()


def whole(text: str, tools: ToolPlan | None, thinking: ThinkingBlock | None) -> Answer:
    """A finished sequence's text, split."""
    thought, content = split_thinking(text, thinking)
    calls: list[ToolCall] = []
    result: str | None = content
    if tools is not None:
        result, calls = parse(content, tools.fmt)
        if not calls:
            result = content
    return Answer(thought, result, tuple(calls))
