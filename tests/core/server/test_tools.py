"""Tool calling: format detection, parsing, streaming, forcing grammars, and the chat route end to end.

The route tests run a runtime that answers with a scripted text, one
character per token, so the answer's tool calls are known exactly.
"""

from __future__ import annotations

import json

import attrs
import llguidance
import pytest

from ifb.runtime import Prepared, SeqOutput, StepOutput
from ifb.server import tools
from ifb.server.tools import HERMES, LLAMA3, MISTRAL, SYSTEM_PROMPT, ToolPlan, ToolStream, parse

from tests.core.fakes import FakeRuntime, text_caps
from tests.core.server.conftest import ENDPOINTS, served
from tests.core.server.test_routes import oai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


# ---- formats and parsing ----

def test_the_template_decides_the_format():
    assert tools.call_format(None) == HERMES and not tools.template_reads_tools(None)
    assert tools.call_format("{{ messages }}") == HERMES  # no tools in the template: our system message
    assert tools.call_format("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert tools.call_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == MISTRAL
    assert tools.call_format("<|start_header_id|>{% for t in tools %}{{ t | tojson }}{% endfor %}") == LLAMA3


def test_parse_hermes():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse(text, HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    # the end of generation may come before the closing tag
    assert parse('<tool_call>{"name": "f", "arguments": {"a": 1}}', HERMES)[1][0].arguments == '{"a": 1}'
    # what does not parse stays content
    for bad in ("no calls here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse(bad, HERMES) == (bad, [])


def test_parse_llama3_and_mistral():
    content, calls = parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', LLAMA3)
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    two = parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', LLAMA3)[1]
    assert [c.name for c in two] == ["a", "b"]
    assert parse("The answer is 4.", LLAMA3) == ("The answer is 4.", [])
    calls = parse('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "f", "arguments": "{\\"a\\": 2}"}]',
                  MISTRAL)[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("f", {"a": 2})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # the ids Mistral's templates take back
    # the marker is a special token, which decoding may have dropped
    assert parse('[{"name": "get_time", "arguments": {}}]', MISTRAL)[1][0].name == "get_time"
    assert parse("[1, 2]", MISTRAL) == ("[1, 2]", [])


@pytest.mark.parametrize("fmt,text,content", [
    (HERMES, 'Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "Sure. "),
    (HERMES, "a < b, and <tool no", "a < b, and <tool no"),
    (LLAMA3, '{"name": "f", "parameters": {}}', ""),
    (LLAMA3, "Plain answer {with braces}", "Plain answer {with braces}"),
    (LLAMA3, "  <|py", "  <|py"),
    (MISTRAL, " The list [1, 2]", " The list [1, 2]"),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}]', ""),
])
def test_tool_stream_holds_calls_back(fmt, text, content):
    stream = ToolStream(fmt)
    pieces = [stream.feed(ch) for ch in text]
    sent = "".join(pieces)
    rest, calls = stream.finish()
    assert sent + rest == content
    if not calls and not text.strip().startswith(("<", "[", "{")):
        assert sent == text  # a plain answer streams as it comes
    assert bool(calls) == ('"name"' in text)
    if calls:
        assert calls[0].name == "f"


def _plan(choice="required", name=None, fmt=HERMES, parallel=False) -> ToolPlan:
    return ToolPlan(tools=(WEATHER, TIME), choice=choice, forced_name=name, parallel=parallel, fmt=fmt,
                    in_template=fmt != HERMES)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
@pytest.mark.parametrize("choice,name,parallel", [("required", None, False), ("required", None, True),
                                                  ("named", "get_weather", False)])
def test_forcing_grammars_compile(fmt, choice, name, parallel):
    grammar = tools.forcing_grammar(_plan(choice, name, fmt, parallel))
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar)) == ""
    if name is not None:
        assert "get_time" not in grammar
    assert tools.forcing_grammar(_plan("auto", fmt=fmt)) is None


def test_rendering_without_template_support():
    plan = tools.plan([WEATHER], "auto", None, template=None)
    messages = tools.render_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ], plan)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert "must call the function get_weather" in tools.render_messages(
        [{"role": "user", "content": "x"}], tools.plan([WEATHER], {"type": "function", "function": {
            "name": "get_weather"}}, None, None))[0]["content"]


def test_rendering_with_template_support_decodes_arguments():
    plan = tools.plan([WEATHER], "auto", None, template="{% for t in tools %}{% endfor %}<tool_call>")
    messages = tools.render_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"}], plan)
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert messages[1]["role"] == "tool"


# ---- the route, on a scripted runtime ----

class CharTokenizer:
    """One token per character (its code point); 0 ends the sequence."""

    eos_token_ids = (0,)

    def __init__(self, chat_template: str | None):
        self.chat_template = chat_template
        self.rendered: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        text = json.dumps({"messages": messages, "tools": tools})
        self.rendered.append(text)
        return text


@attrs.define
class ScriptedRuntime(FakeRuntime):
    script: str = ""

    def prepare(self, spec):
        text = spec.prompt if spec.prompt is not None else self.tokenizer.apply_chat_template(
            list(spec.messages), tools=spec.extras.get("tools"))
        return Prepared(tuple(self.tokenizer.encode(text[-200:])))  # the tail: the context is small

    def execute(self, step):
        outs = []
        for seq, seat in zip(step.seqs, self.seats.apply(step)):
            num_out = len(seat.all_token_ids) - seat.num_prompt_tokens
            token = ord(self.script[num_out]) if seq.is_sampling and num_out < len(self.script) else 0
            outs.append(SeqOutput(seq.request_id, token if seq.is_sampling else None))
        return StepOutput(tuple(outs))


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def scripted(script: str, template: str | None = None):
    runtime = ScriptedRuntime(caps=text_caps(endpoints=dict(ENDPOINTS)), tokenizer=CharTokenizer(template),
                              script=script, max_model_len=4096, num_kv_blocks=2048)
    return served(runtime=runtime)


def ask(url: str, **fields):
    return oai(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "Paris?"}],
                                            tools=[WEATHER, TIME], **fields)


def test_tool_calls_parsed_from_the_answer():
    with scripted("Checking.\n" + CALL) as (url, deployment):
        result = ask(url)
        rendered = deployment.runtime.tokenizer.rendered[-1]
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # this template reads no tools: they went into a system message, in the documented format
    sent = json.loads(rendered)
    assert sent["tools"] is None and sent["messages"][0]["role"] == "system"
    assert sent["messages"][0]["content"].startswith(SYSTEM_PROMPT.split("{tools}")[0])


def test_a_template_that_reads_tools_gets_them():
    with scripted(CALL, template="{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>") as (url, d):
        result = ask(url)
        sent = json.loads(d.runtime.tokenizer.rendered[-1])
    assert result.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "get_time"]
    assert sent["messages"] == [{"role": "user", "content": "Paris?"}]


def test_streamed_tool_calls_accumulate_as_the_openai_client_expects():
    with scripted("Checking. " + CALL) as (url, _):
        chunks = list(ask(url, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking. "  # the call's text never streams as content
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_plain_answers():
    with scripted(CALL) as (url, deployment):
        untouched = ask(url, tool_choice="none")
        assert json.loads(deployment.runtime.tokenizer.rendered[-1])["messages"][0]["role"] == "user"
    assert untouched.choices[0].message.content == CALL and untouched.choices[0].message.tool_calls is None
    with scripted("It is sunny.") as (url, _):
        plain = ask(url)
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(url, stream=True) if c.choices)
    assert plain.choices[0].message.content == "It is sunny." and plain.choices[0].finish_reason == "stop"
    assert streamed == "It is sunny."


def test_a_conversation_with_tool_results():
    with scripted("Sunny.") as (url, deployment):
        result = oai(url).chat.completions.create(model="fake", tools=[WEATHER], messages=[
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
        sent = json.loads(deployment.runtime.tokenizer.rendered[-1])["messages"]
    assert result.choices[0].message.content == "Sunny."
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert "<tool_response>\nsunny" in sent[3]["content"]


def test_required_choice_asks_the_guided_decoder():
    """tool_choice required travels as a grammar; a deployment without a guided decoder refuses it."""
    with scripted(CALL) as (url, _):
        import openai

        with pytest.raises(openai.BadRequestError, match="Guided decoding"):
            ask(url, tool_choice="required")
