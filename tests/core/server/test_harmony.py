"""The harmony format split against OpenAI's own ``openai-harmony``: what it renders as a completion
is parsed here, whole and streamed, into the thinking, answer and calls its own parser finds."""

from __future__ import annotations

import json

import pytest

from ifb.server import harmony
from ifb.server.answer import AnswerStream, whole
from ifb.server.tools import plan
from tests.models.harmony import encoding, text_of

import openai_harmony as h  # noqa: E402 - a test dependency (pyproject's test extra)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TOOLS = plan([WEATHER], "auto", None, "<|start|>x<|channel|>y<|message|>{{ tools }}")


def _assistant(content: str, channel: str, recipient: str | None = None, content_type: str | None = None):
    message = h.Message.from_role_and_content(h.Role.ASSISTANT, content).with_channel(channel)
    if recipient:
        message = message.with_recipient(recipient)
    if content_type:
        message = message.with_content_type(content_type)
    return message


COMPLETIONS = {
    "thinking and answer": [_assistant("The user greets. Answer briefly.", "analysis"),
                            _assistant("Hello! How can I help?", "final")],
    "tool call": [_assistant("Need the weather for Oslo.", "analysis"),
                  _assistant('{"city": "Oslo"}', "commentary", "functions.get_weather", "<|constrain|>json")],
    "two calls and a preamble": [_assistant("Two cities.", "analysis"),
                                 _assistant("Checking both cities.", "commentary"),
                                 _assistant('{"city": "Oslo"}', "commentary", "functions.get_weather", "json"),
                                 _assistant('{"city": "Bergen"}', "commentary", "functions.get_weather", "json")],
    "answer only": [_assistant("Just the answer, with <b>markup</b> and ünïcode.", "final")],
    "two analysis messages": [_assistant("First thought.", "analysis"), _assistant("Second thought.", "analysis"),
                              _assistant("Done.", "final")],
}


def _reference(messages) -> tuple[str, list[int]]:
    """The completion's text after the generation prompt's ``<|start|>assistant``, and its tokens."""
    enc = encoding()
    tokens = [t for m in messages for t in enc.render(m)]
    prefix = enc.encode("<|start|>assistant", allowed_special="all")
    assert tokens[:len(prefix)] == prefix
    return text_of(tokens[len(prefix):]), tokens[len(prefix):]


def _expected(tokens: list[int]):
    """What openai-harmony's own parser finds: (thinking, content, calls)."""
    parsed = encoding().parse_messages_from_completion_tokens(tokens, h.Role.ASSISTANT)
    thinking = [m.content[0].text for m in parsed if m.channel == "analysis"]
    content = [m.content[0].text for m in parsed if m.channel in ("final", "commentary") and not m.recipient]
    calls = [(m.recipient.removeprefix("functions."), json.loads(m.content[0].text))
             for m in parsed if m.recipient and m.recipient.startswith("functions.")]
    return "\n".join(thinking), "\n".join(content), calls


@pytest.mark.parametrize("name", sorted(COMPLETIONS))
@pytest.mark.parametrize("with_end_token", [False, True])
def test_split_equals_openai_harmony(name, with_end_token):
    text, tokens = _reference(COMPLETIONS[name])
    # the sequence-ending <|return|> / <|call|> is an end-of-sequence token: normally not in the text
    if not with_end_token:
        text = text.removesuffix("<|return|>").removesuffix("<|call|>")
    thinking, content, calls = _expected(tokens)
    answer = whole(text, TOOLS, harmony.BLOCK)
    assert answer.thinking == (thinking or None)  # None: no analysis message at all
    assert (answer.text or "") == content
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == calls
    # streamed a character at a time: the same pieces, markers never leak into the deltas
    stream = AnswerStream(TOOLS, harmony.BLOCK)
    pieces = [stream.feed(ch, False) for ch in text] + [stream.feed("", True)]
    assert "".join(p.thinking for p in pieces) == thinking
    assert "".join(p.text for p in pieces) == content
    assert [(c.name, json.loads(c.arguments)) for p in pieces for c in p.calls] == calls
    assert not any("<|" in p.thinking + p.text for p in pieces)


def test_calls_only_with_tools_and_bad_arguments_kept_as_text():
    text, _ = _reference(COMPLETIONS["tool call"])
    assert whole(text, None, harmony.BLOCK).calls == ()  # no tools offered: no call
    broken = text.replace('{"city": "Oslo"}', '{"city": ')
    answer = whole(broken, TOOLS, harmony.BLOCK)
    assert answer.calls == () and answer.text == '{"city": '


def test_text_without_the_format_is_the_answer():
    assert whole("plain words", TOOLS, harmony.BLOCK).text == "plain words"
