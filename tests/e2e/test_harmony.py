"""gpt-oss's harmony format through ``ifb serve``, driven by the official ``openai`` and ``anthropic`` clients.

The tiny random gpt-oss carries the released chat template and the harmony markers as special tokens.
Its output head is refitted (``fit_head_to_answer``) so that greedy decoding of two prompts writes two
completions that ``openai-harmony`` rendered: after the user's question, an analysis message and a call
of ``get_weather``; after that call and its result, an analysis message and a final answer. The
prompts are the template's rendering by transformers, so the second completion comes back only if
the server renders the tool round trip (the call, its reasoning and the result) exactly as the
template does. What comes back is compared with ``openai-harmony``'s own parse of the completions.
"""

from __future__ import annotations

import json

import anthropic
import pytest
import torch

from tests.e2e.test_server import Server
from tests.models.gpt_oss import fit_head_to_answer, save_tiny_harmony_gpt_oss
from tests.models.harmony import encoding, text_of

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo?"}]
THOUGHT_1, ARGUMENTS, THOUGHT_2, ANSWER = "Need the weather.", {"city": "Oslo"}, "It is sunny.", "Sunny in Oslo."
RESULT = "sunny"


def _completion(*messages) -> tuple[str, list[int]]:
    """openai-harmony's rendering of assistant messages, after the generation prompt's ``<|start|>assistant``."""
    enc = encoding()
    tokens = [t for m in messages for t in enc.render(m)]
    prefix = enc.encode("<|start|>assistant", allowed_special="all")
    tokens = tokens[len(prefix):]
    end, done = (enc.encode(t, allowed_special="all") for t in ("<|end|>", "<|return|>"))
    if tokens[-1:] == end:  # a message rendered alone ends in <|end|>; the turn's last ends in <|return|>
        tokens = tokens[:-1] + done
    return text_of(tokens), tokens


def _reference_parse(tokens: list[int]) -> list[tuple[str, str | None, str]]:
    from openai_harmony import Role

    parsed = encoding().parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)
    return [(m.channel, m.recipient, m.content[0].text) for m in parsed]


@pytest.fixture(scope="module")
def completions():
    from openai_harmony import Message, Role

    def say(content, channel, recipient=None, content_type=None):
        m = Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel)
        m = m.with_recipient(recipient) if recipient else m
        return m.with_content_type(content_type) if content_type else m

    call = _completion(say(THOUGHT_1, "analysis"),
                       say(json.dumps(ARGUMENTS), "commentary", "functions.get_weather", "<|constrain|>json"))
    final = _completion(say(THOUGHT_2, "analysis"), say(ANSWER, "final"))
    return call, final


def _round_trip(call_id: str = "call_1") -> list[dict]:
    return [*QUESTION,
            {"role": "assistant", "content": None, "reasoning_content": THOUGHT_1,
             "tool_calls": [{"id": call_id, "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULT}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, completions):
    from transformers import AutoTokenizer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        directory = save_tiny_harmony_gpt_oss(tmp_path_factory.mktemp("gpt_oss_harmony"), seed=3)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        template_messages = [*QUESTION, {"role": "assistant", "thinking": THOUGHT_1, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
            {"role": "tool", "content": RESULT}]
        prompts = [tokenizer.apply_chat_template(m, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
                   for m in (QUESTION, template_messages)]
        (call_text, _), (final_text, _) = completions
        fit_head_to_answer(directory, list(zip(prompts, (call_text, final_text))))
    finally:
        torch.set_num_threads(before)
    started = Server(tmp_path_factory.mktemp("logs") / "harmony.log", str(directory), "--plugin", "text",
                     "--enable-in-flight-batching", "--max-batch-size", "2", "--served-model-name", "oss")
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


ASK = dict(model="oss", tools=[WEATHER], max_tokens=80, temperature=0)


def test_reference_parse_is_what_the_fixture_says(completions):
    (_, call_tokens), (_, final_tokens) = completions
    assert _reference_parse(call_tokens) == [("analysis", None, THOUGHT_1),
                                             ("commentary", "functions.get_weather", json.dumps(ARGUMENTS))]
    assert _reference_parse(final_tokens) == [("analysis", None, THOUGHT_2),
                                              ("final", None, ANSWER)]


def test_chat_completions_tool_round_trip(server):
    client = server.client()
    first = client.chat.completions.create(messages=QUESTION, **ASK).choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.reasoning_content == THOUGHT_1 and not first.message.content
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    # the call goes back with its reasoning and the tool's result: the template's own round trip
    second = client.chat.completions.create(messages=_round_trip(call.id), **ASK).choices[0]
    assert second.finish_reason == "stop"
    assert (second.message.reasoning_content, second.message.content) == (THOUGHT_2, ANSWER)
    assert not second.message.tool_calls


def test_chat_completions_streamed(server):
    client = server.client()
    thought, content, calls = "", "", []
    for chunk in client.chat.completions.create(messages=QUESTION, stream=True, **ASK):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
    assert thought == THOUGHT_1 and content == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", ARGUMENTS)]
    thought, content = "", ""
    for chunk in client.chat.completions.create(messages=_round_trip(), stream=True, **ASK):
        if chunk.choices:
            thought += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (thought, content) == (THOUGHT_2, ANSWER)


def test_responses_reasoning_item_and_function_call(server):
    client = server.client()
    tool = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(model="oss", input=QUESTION[0]["content"], tools=[tool], temperature=0,
                                       max_output_tokens=80)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == THOUGHT_1
    assert response.output[1].name == "get_weather" and json.loads(response.output[1].arguments) == ARGUMENTS


def test_messages_thinking_block_and_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "Get the weather",
            "input_schema": WEATHER["function"]["parameters"]}
    message = client.messages.create(model="oss", max_tokens=80, tools=[tool], messages=QUESTION,
                                     extra_body={"temperature": 0})
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == THOUGHT_1 and message.content[1].input == ARGUMENTS
    assert message.stop_reason == "tool_use"


def test_guided_decoding_is_refused_with_the_format(server):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError, match="harmony"):
        client.chat.completions.create(model="oss", messages=QUESTION, max_tokens=8,
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="harmony"):
        client.chat.completions.create(messages=QUESTION, tool_choice="required", **ASK)
