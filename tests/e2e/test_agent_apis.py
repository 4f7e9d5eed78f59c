"""The APIs agents speak, driven by clients no one here wrote, against ``ifb serve``.

Two servers start once for the module, both under in-flight batching: the real
default model (the ``openai`` client's Responses API, the OpenAI Agents SDK,
the ``anthropic`` SDK and LangChain's ``ChatAnthropic``), and a tiny Qwen3
thinking model with Qwen3's published template (thinking split from the answer
in chat completions, the Responses API and the Messages API, streamed and not).
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from tests.e2e.test_server import KEY, Server
from tests.models.reasoning import ANSWER, THOUGHT, save_reasoning_model

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
                     "input_schema": WEATHER["parameters"]}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from ifb_plugins.text.default_model import resolve_model

    resolve_model(None)
    model = save_reasoning_model(tmp_path_factory.mktemp("thinker"))
    logs = tmp_path_factory.mktemp("servers")
    started = {
        "default": Server(logs / "default.log", "--enable-in-flight-batching", "--max-batch-size", "4",
                          api_key=KEY),
        "thinker": Server(logs / "thinker.log", str(model), "--plugin", "text", "--enable-in-flight-batching",
                          "--max-batch-size", "2", "--served-model-name", "thinker"),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture
def default(servers):
    return servers["default"]


@pytest.fixture(scope="module")
def name(servers) -> str:
    """The default server's model name."""
    return servers["default"].client().models.list().data[0].id


@pytest.fixture
def thinker(servers):
    return servers["thinker"]


def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key or "none", max_retries=0, timeout=120)


# ---- the Responses API with the openai client ----

def test_responses_plain_and_streamed(default, name):
    client = default.client()
    response = client.responses.create(model=name, input="Name a colour.", max_output_tokens=8, temperature=0)
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 8
    deltas, kinds = [], set()
    with client.responses.stream(model=name, input="Name a colour.", max_output_tokens=8, temperature=0) as stream:
        for event in stream:
            kinds.add(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert {"response.created", "response.output_item.added", "response.output_text.delta"} <= kinds
    assert "".join(deltas) == final.output_text == response.output_text  # greedy: the same answer


def test_responses_function_tool_round_trip(default, name):
    client = default.client()
    first = client.responses.create(model=name, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    second = client.responses.create(
        model=name, input=[{"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER], max_output_tokens=12, temperature=0)
    assert second.output_text


def test_responses_json_schema_and_previous_response_id(default, name):
    client = default.client()
    first = client.responses.create(
        model=name, input="Give a city as JSON.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    assert set(json.loads(first.output_text)) == {"city"}
    follow = client.responses.create(model=name, input="And another one?", previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    assert follow.previous_response_id == first.id and follow.output_text
    # the previous turn is in the prompt: more input tokens than the question alone
    alone = client.responses.create(model=name, input="And another one?", max_output_tokens=1, store=False)
    assert follow.usage.input_tokens > alone.usage.input_tokens
    assert client.responses.retrieve(first.id).id == first.id


def test_agents_sdk_runs_an_agent_with_a_function_tool(default, name):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return f"Sunny in {city}"

    model = OpenAIResponsesModel(model=name, openai_client=AsyncOpenAI(
        base_url=f"{default.url}/v1", api_key=KEY, max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert asked and result.final_output == f"Sunny in {asked[0]}"


# ---- the Messages API with the anthropic SDK and LangChain ----

def test_messages_plain_streamed_and_count_tokens(default, name):
    client = claude(default)
    message = client.messages.create(model=name, max_tokens=8, messages=[{"role": "user", "content": "Hi!"}])
    assert message.content[0].type == "text" and message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 8
    with client.messages.stream(model=name, max_tokens=8, messages=[{"role": "user", "content": "Hi!"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text and final.usage.input_tokens == message.usage.input_tokens
    count = client.messages.count_tokens(model=name, messages=[{"role": "user", "content": "Hi!"}])
    assert count.input_tokens == message.usage.input_tokens


def test_messages_tool_use_round_trip(default, name):
    client = claude(default)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(model=name, max_tokens=40, messages=[question], tools=[ANTHROPIC_WEATHER],
                                   tool_choice={"type": "any"})
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "get_weather" and "city" in uses[0].input
    second = client.messages.create(model=name, max_tokens=12, tools=[ANTHROPIC_WEATHER], messages=[
        question, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]}])
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_langchain_chat_anthropic(default, name):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=name, base_url=default.url, api_key=KEY, max_tokens=8, max_retries=0)
    reply = llm.invoke("Say hello.")
    assert isinstance(reply.content, str) and reply.content
    assert "".join(chunk.content if isinstance(chunk.content, str) else "" for chunk in llm.stream("Say hello."))


# ---- thinking split from the answer, on the tiny Qwen3 thinker ----

def test_chat_completions_split_thinking(thinker):
    client = thinker.client()
    ask = dict(model="thinker", messages=[{"role": "user", "content": "Say hi"}], max_tokens=20, temperature=0)
    message = client.chat.completions.create(**ask).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
    thought, answer = "", ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            answer += delta.content or ""
    assert (thought, answer) == (THOUGHT, ANSWER)
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == ANSWER and getattr(off.choices[0].message, "reasoning_content", None) \
        is None
    assert client.chat.completions.create(**ask, reasoning_effort="minimal").choices[0].message.content == ANSWER


def test_responses_split_thinking(thinker):
    client = thinker.client()
    response = client.responses.create(model="thinker", input="Say hi", max_output_tokens=20, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT and response.output_text == ANSWER
    thought = ""
    with client.responses.stream(model="thinker", input="Say hi", max_output_tokens=20, temperature=0) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                thought += event.delta
        final = stream.get_final_response()
    assert thought == THOUGHT and final.output_text == ANSWER
    off = client.responses.create(model="thinker", input="Say hi", max_output_tokens=20, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"] and off.output_text == ANSWER


def test_messages_split_thinking(thinker):
    client = claude(thinker)
    ask = dict(model="thinker", max_tokens=20, messages=[{"role": "user", "content": "Say hi"}])
    message = client.messages.create(**ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
        [("thinking", THOUGHT), ("text", ANSWER)]
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == ANSWER
    off = client.messages.create(**ask, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == ANSWER


def test_guided_decoding_applies_after_the_thinking(thinker):
    client = thinker.client()
    response = client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "Say hi"}], max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["ok"]}}})
    message = response.choices[0].message
    # the thinking is the model's own (unconstrained); the answer after it follows the schema
    assert message.reasoning_content == THOUGHT and json.loads(message.content) == "ok"
