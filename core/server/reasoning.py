"""Reasoning output: a thinking model's ``<think>...</think>`` split from its answer.

``--reasoning-parser`` picks the parser once, at start-up:

* ``qwen3``: the output is thinking only when it opens a ``<think>`` block
  itself (Qwen3 writes one unless thinking is switched off);
* ``deepseek_r1``: the output starts inside the block (the template's
  generation prompt opens it) and is thinking up to ``</think>``;
* ``auto`` (the default): none when the chat template never writes
  ``<think>``; else ``deepseek_r1`` when its generation prompt ends inside an
  open block, ``qwen3`` otherwise;
* ``harmony``: OpenAI's harmony format (gpt-oss): the ``analysis`` channel is
  the thinking, ``final`` the answer (``ifb.server.harmony``); ``auto`` picks
  it for a template that writes the format;
* ``none``: the output is all answer.

Per request, ``enable_thinking`` (``chat_template_kwargs``), ``reasoning_effort``
and the Responses and Messages APIs' own fields become the template's thinking
switch (``enable_thinking``), where the template has one; ``reasoning_effort``
also reaches a template that reads it (the harmony format knows ``low``,
``medium`` and ``high``: ``none`` and ``minimal`` become ``low``). With thinking switched off the parser
is off for that request. Guided decoding starts after the block
(``RequestSpec.thinking``).
"""

from __future__ import annotations

from typing import Any

import attrs

from ifb.params import ThinkingBlock
from ifb.server import harmony
from ifb.server.errors import ApiError

PARSERS = ("auto", "qwen3", "deepseek_r1", "harmony", "none")
START, END = "<think>", "</think>"
#: reasoning efforts (OpenAI's words); ``none`` and ``minimal`` switch thinking off where the template can
EFFORTS = ("none", "minimal", "low", "medium", "high")
#: template variables the server sets itself: a request's ``chat_template_kwargs`` may not replace them
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@attrs.frozen
class Reasoning:
    """The deployment's reasoning set-up, decided at start-up from the flag and the chat template."""

    parser: str  # qwen3 | deepseek_r1 | harmony | none
    #: the template reads ``enable_thinking`` (Qwen3's switch)
    has_switch: bool = False
    #: the template reads ``reasoning_effort``
    reads_effort: bool = False

    @property
    def is_on(self) -> bool:
        return self.parser != "none"


def _opens_block(text: str) -> bool:
    return text.rfind(START) > text.rfind(END)


def detect(choice: str, template: str | None, render=None) -> Reasoning:
    """The set-up for ``--reasoning-parser choice``; ``render(kwargs)`` renders a one-message chat's prompt."""
    if choice not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}; got {choice!r}")
    template = template or ""
    has_switch = "enable_thinking" in template
    reads_effort = "reasoning_effort" in template
    parser = choice
    if choice == "auto":
        parser = "none"
        if harmony.template_speaks(template):
            parser = "harmony"
        elif START in template and END in template:
            opened = False
            if render is not None:
                try:
                    opened = _opens_block(render({}))
                except Exception:  # noqa: BLE001 - a template that needs more than one user message
                    opened = False
            parser = "deepseek_r1" if opened else "qwen3"
    return Reasoning(parser=parser, has_switch=has_switch, reads_effort=reads_effort)


@attrs.frozen
class ThinkingChoice:
    """What one request asks of thinking: on, off or the template's default, and an effort."""

    enabled: bool | None = None
    effort: str | None = None


def effort_choice(effort: str | None, param: str) -> ThinkingChoice:
    """``reasoning_effort`` (or ``reasoning.effort``) as a choice; 400 for a word OpenAI does not use."""
    if effort is None:
        return ThinkingChoice()
    if effort not in EFFORTS:
        raise ApiError(400, f"unknown reasoning effort {effort!r} ({', '.join(EFFORTS)})", param=param)
    return ThinkingChoice(enabled=effort not in ("none", "minimal"), effort=effort)


def template_kwargs(reasoning: Reasoning, choice: ThinkingChoice,
                    given: dict[str, Any] | None = None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """The chat template's variables for a request: the caller's own, then its thinking choice."""
    kwargs = dict(given or {})
    reserved = sorted(RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise ApiError(400, f"{param} may not set {', '.join(reserved)} (the server renders them)", param=param)
    enabled = kwargs.get("enable_thinking", choice.enabled)
    if enabled is not None and not isinstance(enabled, bool):
        raise ApiError(400, "enable_thinking must be a boolean", param=f"{param}.enable_thinking")
    if enabled is not None and reasoning.has_switch:
        kwargs["enable_thinking"] = enabled
    if choice.effort is not None and reasoning.reads_effort:
        effort = choice.effort
        if reasoning.parser == "harmony" and effort in ("none", "minimal"):
            effort = "low"
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def thinking_block(reasoning: Reasoning, kwargs: dict[str, Any]) -> ThinkingBlock | None:
    """The block a request's answer may start with (None: the parser is off for it)."""
    if reasoning.parser == "harmony":
        return harmony.BLOCK  # the format's channels are there whatever the effort
    if not reasoning.is_on or (reasoning.has_switch and kwargs.get("enable_thinking") is False):
        return None
    return ThinkingBlock(START, END, is_open=reasoning.parser == "deepseek_r1")


class ReasoningSplitter:
    """Splits streamed text into (thinking, answer) deltas, holding back what may be a tag's first part.

    The whitespace around the thinking and at the answer's start is dropped, as
    Qwen3's template drops it when the turn is rendered again.
    """

    def __init__(self, block: ThinkingBlock):
        self.block = block
        self._state = "thinking" if block.is_open else "start"
        self._held = ""
        self._answer_started = False
        self._thought_started = False
        #: the output had a thinking block (open from the prompt, or opened by the model)
        self.had_thinking = block.is_open

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        thought, answer = "", ""
        while True:
            if self._state == "start":
                lead = self._held.lstrip()
                if lead.startswith(self.block.start):
                    self._held = lead[len(self.block.start):]
                    self._state = "thinking"
                    self.had_thinking = True
                    continue
                if lead and not self.block.start.startswith(lead):
                    self._state = "answer"
                    continue
                return thought, answer  # nothing yet, or the start of an opening tag
            if self._state == "thinking":
                if not self._thought_started:
                    if self.block.is_open and self._held.lstrip().startswith(self.block.start):
                        self._held = self._held.lstrip()[len(self.block.start):]
                    self._held = self._held.lstrip()
                    self._thought_started = bool(self._held)
                at = self._held.find(self.block.end)
                if at != -1:
                    thought += self._held[:at].rstrip()
                    self._held = self._held[at + len(self.block.end):]
                    self._state = "answer"
                    continue
                keep = _partial_suffix(self._held, self.block.end)
                body = self._held[:len(self._held) - keep]
                # trailing whitespace may be the last before the end tag: held until more arrives
                out = body.rstrip()
                thought += out
                self._held = self._held[len(out):]
                return thought, answer
            # answer
            if not self._answer_started:
                self._held = self._held.lstrip()
                self._answer_started = bool(self._held)
            answer += self._held
            self._held = ""
            return thought, answer

    def finish(self) -> tuple[str, str]:
        """What is still held once generation ended (an unfinished tag is text)."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return held.strip(), ""
        if self._state == "start":
            return "", held.strip()
        return "", held if self._answer_started else held.lstrip()


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split(text: str, block: ThinkingBlock | None) -> tuple[str | None, str]:
    """A whole answer as (thinking or None, answer)."""
    if block is None:
        return None, text
    splitter = ReasoningSplitter(block)
    thought, answer = splitter.feed(text)
    more_thought, more_answer = splitter.finish()
    thought += more_thought
    answer += more_answer
    return (thought if splitter.had_thinking else None), answer
