"""Tool calling: tools into the prompt, a grammar for forced calls, and calls parsed back out.

The checkpoint's chat template decides. A template that reads ``tools``
renders them itself (Qwen2.5/3, Llama 3.1+, Mistral, Hermes), and the
calls are parsed in the format it teaches the model:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen);
* ``llama3``: a bare JSON object ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS]`` and a JSON array of ``{"name": ..., "arguments": {...}}``;
* ``harmony``: a ``commentary`` message to ``functions.NAME`` whose body is the arguments
  (gpt-oss; split with the rest of the answer's channels, ``ifb.server.harmony``).

A template that does not read ``tools`` (SmolLM2's, for one) gets them in a
system message, ``SYSTEM_PROMPT``, that teaches the ``hermes`` format.
``tool_choice`` ``required`` or a named function becomes a grammar the
guided decoder enforces, so the answer always parses.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from typing import Any

import attrs

from ifb.server import harmony
from ifb.server.errors import ApiError

HERMES, LLAMA3, MISTRAL, HARMONY = "hermes", "llama3", "mistral", "harmony"

SYSTEM_PROMPT = """# Tools

You may call one or more of these functions to answer. Their signatures, as JSON Schema, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:
<tool_call>
{{"name": "<function-name>", "arguments": {{<arguments>}}}}
</tool_call>"""

#: JSON in one fixed layout, as the guided decoder writes it elsewhere (a small model given free
#: whitespace wanders into blank lines)
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` variable."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def call_format(template: str | None) -> str:
    """The tool-call format the loaded template teaches (``hermes`` when it teaches none)."""
    if not template_reads_tools(template):
        return HERMES
    if harmony.template_speaks(template):
        return HARMONY
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>" in template or "<|python_tag|>" in template:
        return LLAMA3
    return HERMES


@attrs.frozen
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = attrs.field(factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@attrs.frozen
class ToolPlan:
    """What a chat request with tools needs: how to render it, what to force, how to parse."""

    tools: tuple[dict, ...]  # OpenAI tool objects (type function)
    choice: str  # auto | required | named
    forced_name: str | None
    parallel: bool
    fmt: str
    in_template: bool  # the template renders the tools itself

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
         template: str | None) -> ToolPlan | None:
    """The plan for a request, or None when it has no tools or ``tool_choice`` is ``none``."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if not tools or tool_choice == "none":
        return None
    names = [t["function"]["name"] for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ApiError(400, f"the tool {duplicate!r} is given twice", param="tools")
    forced = None
    if isinstance(tool_choice, dict):
        forced = tool_choice["function"]["name"]
        if forced not in names:
            raise ApiError(400, f"tool_choice names the function {forced!r}, which is not among the tools "
                                f"({', '.join(names)})", param="tool_choice.function.name")
        choice = "named"
    else:
        choice = tool_choice or "auto"
    return ToolPlan(tools=tuple(tools), choice=choice, forced_name=forced,
                    parallel=bool(parallel) and choice != "named", fmt=call_format(template),
                    in_template=template_reads_tools(template))


# ---- rendering ----

def _system_prompt(plan_: ToolPlan) -> str:
    text = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in plan_.tools))
    if plan_.choice == "required":
        text += "\n\nYou must call at least one function."
    elif plan_.choice == "named":
        text += f"\n\nYou must call the function {plan_.forced_name}."
    return text


def _arguments(call: dict, where: str) -> Any:
    raw = call.get("function", {}).get("arguments")
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments is not valid JSON", param=f"{where}.function.arguments") \
                from None
    return raw if raw is not None else {}


def render_messages(messages: list[dict], plan_: ToolPlan | None) -> list[dict]:
    """Messages for the template: tool calls and results in the form it expects.

    A template that reads ``tools`` gets assistant ``tool_calls`` with their
    arguments decoded (as Hugging Face templates expect) and ``tool`` messages
    as they are. Any other template gets the tool list in a system message,
    earlier calls as ``<tool_call>`` text and results as user messages in
    ``<tool_response>`` blocks.
    """
    in_template = plan_ is not None and plan_.in_template
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            decoded = [{"id": c.get("id"), "type": "function",
                        "function": {"name": c["function"]["name"],
                                     "arguments": _arguments(c, f"messages[{i}].tool_calls[{j}]")}}
                       for j, c in enumerate(calls)]
            if in_template:
                message["tool_calls"] = decoded
            else:
                blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                     ensure_ascii=False) for c in decoded]
                text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
                message["content"] = f"{message['content']}\n{text}" if message.get("content") else text
        if message["role"] == "tool" and not in_template:
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        out.append(message)
    if plan_ is not None and not plan_.in_template:
        prompt = _system_prompt(plan_)
        if out and out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- forcing a call ----

def _call_schema(plan_: ToolPlan, tool: dict) -> dict:
    key = "parameters" if plan_.fmt == LLAMA3 else "arguments"
    params = tool["function"].get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def forcing_grammar(plan_: ToolPlan) -> str | None:
    """A Lark grammar (llguidance's dialect, with ``%json``) whose every sentence is a valid call."""
    if plan_.choice not in ("required", "named"):
        return None
    tools = [t for t in plan_.tools if plan_.forced_name in (None, t["function"]["name"])]
    alternatives = [_call_schema(plan_, t) for t in tools]
    one = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    one = {"x-guidance": _JSON_LAYOUT, **one}
    if plan_.fmt == MISTRAL:
        array: dict[str, Any] = {"x-guidance": _JSON_LAYOUT, "type": "array", "items": one, "minItems": 1}
        if not plan_.parallel:
            array["maxItems"] = 1
        return f"start: %json {json.dumps(array)}"
    if plan_.fmt == LLAMA3:
        calls = 'start: call (";" call)*' if plan_.parallel else "start: call"
        return f"{calls}\ncall: %json {json.dumps(one)}"
    calls = 'start: block ("\\n" block)*' if plan_.parallel else "start: block"
    return f'{calls}\nblock: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(one)}'


# ---- parsing ----

def _mistral_id() -> str:
    # Mistral's templates take back only ids of 9 letters and digits
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _call_of(obj: Any, fmt: str = HERMES) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    if fmt == MISTRAL:
        return ToolCall(name=obj["name"], arguments=arguments, id=_mistral_id())
    return ToolCall(name=obj["name"], arguments=arguments)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """Split a model's answer into (content, tool calls). An answer that does not parse is content."""
    if fmt == HERMES:
        start = text.find("<tool_call>")
        if start == -1:
            return text, []
        calls = [_call_of(_json(m.group(1))) for m in _HERMES_BLOCK.finditer(text, start)]
        if not calls or None in calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls  # type: ignore[return-value]
    body = text.strip()
    if fmt == MISTRAL:
        at = body.find("[TOOL_CALLS]")
        content = body[:at].strip() if at > 0 else ""
        body = body[at + len("[TOOL_CALLS]"):].strip() if at != -1 else body
        parsed = _json(body) if body.startswith("[") else None
        items = parsed if isinstance(parsed, list) else None
    else:
        content = ""
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        parsed = _json(body)
        items = [parsed] if parsed is not None else [_json(p) for p in body.split(";")]
    calls = [_call_of(item, fmt) for item in items or ()]
    if not calls or None in calls:
        return text, []
    return content or None, calls  # type: ignore[return-value]


class ToolStream:
    """Streams content until a tool call may be starting, then holds the rest for ``finish``."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._text = ""
        self._sent = 0
        self._holding = False

    def _marker(self) -> tuple[int | None, bool]:
        """Where held-back text starts (None: nowhere), and whether a call has surely begun there."""
        if self.fmt == HERMES:
            at = self._text.find("<tool_call>", self._sent)
            if at != -1:
                return at, True
            for k in range(min(len("<tool_call>") - 1, len(self._text) - self._sent), 0, -1):
                if "<tool_call>".startswith(self._text[-k:]):
                    return len(self._text) - k, False
            return None, False
        # Llama 3 and Mistral answer with calls only: what matters is how the answer starts
        lead = self._text.lstrip()
        if not lead:
            return 0, False
        openers = ("[TOOL_CALLS]", "[") if self.fmt == MISTRAL else ("<|python_tag|>", "{")
        if any(lead.startswith(o) for o in openers):
            return 0, True
        if any(o.startswith(lead) for o in openers):
            return 0, False
        return None, False

    def feed(self, text: str) -> str:
        """Add generated text; returns the part that may go out as content now."""
        self._text += text
        if self._holding:
            return ""
        at, certain = self._marker()
        self._holding = certain
        end = len(self._text) if at is None else at
        out = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) once generation ended."""
        rest = self._text[self._sent:]
        if not rest:
            return "", []
        content, calls = parse(rest, self.fmt)
        if not calls:
            return rest, []
        return content or "", calls
