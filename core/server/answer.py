"""One generated answer as typed pieces: thinking, answer text, tool calls.

Chat completions, the Responses API and the Messages API render the same
pieces in their own shapes; this is where a sequence's text is split once:
the thinking block first (``reasoning``), then tool calls out of the answer
(``tools``). A request in the harmony format (``ThinkingBlock.has_channels``)
is split by its channels instead (``harmony``).
"""

from __future__ import annotations

import attrs

from ifb.params import ThinkingBlock
from ifb.server.harmony import HarmonyStream, call_arguments
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
        self._harmony = HarmonyStream() if thinking is not None and thinking.has_channels else None
        self._splitter = ReasoningSplitter(thinking) if thinking is not None and self._harmony is None else None
        self._tools = ToolStream(tools.fmt) if tools is not None and self._harmony is None else None
        self._plan = tools

    @property
    def had_thinking(self) -> bool:
        if self._harmony is not None:
            return self._harmony.had_thinking
        return self._splitter is not None and self._splitter.had_thinking

    def _feed_harmony(self, harmony: HarmonyStream, text: str, finished: bool) -> Piece:
        thought, content = harmony.feed(text)
        if not finished:
            return Piece(thought, content)
        more_thought, more_content = harmony.finish()
        calls: list[ToolCall] = []
        content += more_content
        for call in harmony.calls if self._plan is not None else ():
            arguments = call_arguments(call)
            if arguments is None:  # not a JSON object: shown as written rather than lost
                content += call.arguments
            else:
                calls.append(ToolCall(name=call.name, arguments=arguments))
        return Piece(thought + more_thought, content, tuple(calls))

    def feed(self, text: str, finished: bool) -> Piece:
        if self._harmony is not None:
            return self._feed_harmony(self._harmony, text, finished)
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
    if thinking is not None and thinking.has_channels:
        stream = AnswerStream(tools, thinking)
        piece = stream.feed(text, finished=True)
        return Answer(piece.thinking if stream.had_thinking else None,
                      piece.text if piece.text or not piece.calls else None, piece.calls)
    thought, content = split_thinking(text, thinking)
    calls: list[ToolCall] = []
    result: str | None = content
    if tools is not None:
        result, calls = parse(content, tools.fmt)
        if not calls:
            result = content
    return Answer(thought, result, tuple(calls))
