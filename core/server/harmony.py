"""OpenAI's harmony format (gpt-oss): an answer as a sequence of channel messages.

The chat template's generation prompt ends with ``<|start|>assistant``; the
model then writes messages, each a header and a body::

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>

A header names the channel and, for a tool call, the recipient
(``to=functions.NAME``, before or after the channel) and a content type
(``json`` or ``<|constrain|>json``). ``analysis`` bodies are the thinking,
``final`` bodies and recipient-less ``commentary`` (a preamble the model
shows the user) the answer, and a body addressed to ``functions.NAME`` a
tool call whose arguments are its JSON. Messages to other recipients (the
built-in ``browser`` and ``python`` tools, which this server does not run)
are dropped. Bodies are kept exactly as written; two bodies of one kind are
joined by a newline.

The markers are special tokens: a request in this format decodes with them
kept (``SamplingParams.skip_special_tokens``). ``<|return|>`` and ``<|call|>``
are end-of-sequence tokens, so usually the text simply ends.
"""

from __future__ import annotations

import json
import re

import attrs

from ifb.params import ThinkingBlock

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
_BODY_ENDS = (END, RETURN, CALL)
#: the block ``RequestSpec.thinking`` carries for a request in this format
BLOCK = ThinkingBlock(start=f"{CHANNEL}analysis{MESSAGE}", end=END, has_channels=True)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")
FUNCTIONS = "functions."


def template_speaks(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss's does)."""
    return bool(template) and CHANNEL in template and MESSAGE in template and START in template


@attrs.frozen
class Call:
    """A tool call as written: the function's name and its argument text."""

    name: str
    arguments: str


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may begin one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


class HarmonyStream:
    """Splits streamed harmony text into (thinking, content) deltas; calls come from ``finish``.

    ``feed`` returns what may go out now: a body's text streams as it comes,
    holding back only what may be the start of a marker. A header is held
    whole until its ``<|message|>``.
    """

    def __init__(self) -> None:
        self._held = ""
        self._state = "header"  # header | body | between
        self._kind = ""  # the open body's: thinking | content | call | drop
        self._call_name = ""
        self._call_body = ""
        self._has_kind: dict[str, bool] = {}
        self.calls: list[Call] = []
        #: whether any analysis message was seen
        self.had_thinking = False
        #: whether the text ever had a header (False: the model ignored the format; its text is content)
        self._saw_header = False

    def _open(self, header: str) -> str:
        """Start a body for ``header``; returns the separator its first text needs."""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = recipient.group(1) if recipient else ""
        if name.startswith(FUNCTIONS):
            self._kind, self._call_name, self._call_body = "call", name[len(FUNCTIONS):], ""
            return ""
        if name and name != "all":
            self._kind = "drop"
            return ""
        self._kind = "thinking" if channel is not None and channel.group(1) == "analysis" else "content"
        if self._kind == "thinking":
            self.had_thinking = True
        separator = "\n" if self._has_kind.get(self._kind) else ""
        self._has_kind[self._kind] = True
        return separator

    def _emit(self, text: str, out: dict[str, str]) -> None:
        if self._kind == "call":
            self._call_body += text
        elif self._kind in out:
            out[self._kind] += text

    def _close(self) -> None:
        if self._kind == "call":
            self.calls.append(Call(self._call_name, self._call_body))
        self._kind = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        out = {"thinking": "", "content": ""}
        while True:
            if self._state == "header":
                at = self._held.find(MESSAGE)
                if at == -1:
                    return out["thinking"], out["content"]
                header, self._held = self._held[:at], self._held[at + len(MESSAGE):]
                self._saw_header = True
                separator = self._open(header)
                self._state = "body"
                self._emit(separator, out)
                continue
            if self._state == "body":
                ends = [(self._held.find(m), m) for m in _BODY_ENDS]
                found = min(((at, m) for at, m in ends if at != -1), default=None)
                if found is None:
                    keep = _partial_marker(self._held, _BODY_ENDS)
                    self._emit(self._held[:len(self._held) - keep], out)
                    self._held = self._held[len(self._held) - keep:]
                    return out["thinking"], out["content"]
                at, marker = found
                self._emit(self._held[:at], out)
                self._held = self._held[at + len(marker):]
                self._close()
                self._state = "between"
                continue
            # between messages: skip to the next <|start|>, whose role and header follow
            at = self._held.find(START)
            if at == -1:
                keep = _partial_marker(self._held, (START,))
                self._held = self._held[len(self._held) - keep:]
                return out["thinking"], out["content"]
            self._held = self._held[at + len(START):]
            self._state = "header"

    def finish(self) -> tuple[str, str]:
        """What is still held once generation ended: an open body is closed as written."""
        held, self._held = self._held, ""
        out = {"thinking": "", "content": ""}
        if self._state == "body":
            self._emit(held, out)
            self._close()
        elif self._state == "header" and not self._saw_header:
            out["content"] = held  # no harmony at all: the text is the answer
        return out["thinking"], out["content"]


def call_arguments(call: Call) -> str | None:
    """A call's arguments as JSON text (normalized), or None when they are not a JSON object."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
