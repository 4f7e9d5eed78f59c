"""Request parsing (strict types, unknown keys) and the mapping to RequestSpec."""

from __future__ import annotations

import json

import pytest

from ifb.server.convert import chat_spec, completion_spec
from ifb.server.errors import ApiError
from ifb.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body, structure


def chat(**fields):
    return structure({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def completion(**fields):
    return structure({"prompt": "hi", **fields}, CompletionRequest)


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("field,value,words", [
    ("max_tokens", "5", "expected an integer"),
    ("max_tokens", True, "expected an integer"),
    ("max_tokens", 2.5, "expected an integer"),
    ("temperature", "hot", "expected a number"),
    ("temperature", False, "expected a number"),
    ("stream", 1, "expected a boolean"),
    ("stop", 3, "expected a string or a list of strings"),
    ("stop_token_ids", "abc", "expected a list of integers"),
    ("logit_bias", [1], "expected an object"),
    ("stream_options", "yes", "expected an object"),
])
def test_wrong_types_name_the_field(field, value, words):
    error = error_of(completion, **{field: value})
    assert error.param == field
    assert field in error.message and words in error.message


def test_numbers_are_not_coerced_but_ints_are_numbers():
    assert completion(temperature=1).temperature == 1.0
    assert isinstance(completion(temperature=1).temperature, float)
    assert completion(stop="x").stop == "x"
    assert completion(stop=["a", "b"]).stop == ["a", "b"]


def test_unknown_keys_are_errors_at_every_level():
    assert "unknown field(s): frobnicate" in error_of(completion, frobnicate=1).message
    nested = error_of(chat, stream=True, stream_options={"include_usage": True, "extra": 1})
    assert nested.param == "stream_options" and "extra" in nested.message
    part = error_of(structure, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
                    ChatCompletionRequest)
    assert part.param == "messages[0].content[0]"


def test_missing_required_fields():
    assert error_of(structure, {}, CompletionRequest).param == "prompt"
    assert error_of(structure, {"messages": [{"content": "x"}]}, ChatCompletionRequest).param == "messages[0].role"


@pytest.mark.parametrize("raw,words", [
    (b"", "empty"), (b"{", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "not valid JSON"),
    (b'"text"', "JSON object"),
])
def test_malformed_bodies(raw, words):
    assert words in error_of(parse_body, raw, CompletionRequest).message


def test_completion_prompt_shapes():
    assert completion_spec(completion(prompt="abc"), {}).prompt == "abc"
    assert completion_spec(completion(prompt=[5, 6]), {}).prompt_token_ids == (5, 6)
    assert completion_spec(completion(prompt=["one"]), {}).prompt == "one"
    assert completion_spec(completion(prompt=[[7, 8]]), {}).prompt_token_ids == (7, 8)
    assert "one prompt per request" in error_of(completion_spec, completion(prompt=["a", "b"]), {}).message


def test_completion_sampling_mapping_and_defaults():
    spec = completion_spec(completion(), {})
    assert spec.params.max_tokens == 16  # OpenAI's default for completions
    assert spec.params.temperature == 1.0 and spec.params.top_k == 0
    spec = completion_spec(completion(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=3, logprobs=2, stop="\n", stop_token_ids=[9],
        ignore_eos=True, n=2, stream=True, user="u", logit_bias={}), {"lora": "x"})
    p = spec.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (7, 0.5, 0.9, 40, 0.05, 1.1)
    assert (p.presence_penalty, p.frequency_penalty, p.seed, p.logprobs, p.n) == (0.5, -0.5, 3, 2, 2)
    assert p.stop == ("\n",) and p.stop_token_ids == (9,) and p.ignore_eos
    assert spec.stream and spec.extras == {"lora": "x"}


@pytest.mark.parametrize("fields,param", [
    ({"echo": True, "logprobs": 1}, "echo"), ({"suffix": "x"}, "suffix"),
    ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_completion_fields(fields, param):
    assert error_of(completion_spec, completion(**fields), {}).param == param


def test_chat_defaults_and_max_completion_tokens():
    assert chat_spec(chat(), {}).params.max_tokens is None  # the engine fills the remaining context
    assert chat_spec(chat(max_tokens=5), {}).params.max_tokens == 5
    assert chat_spec(chat(max_tokens=5, max_completion_tokens=9), {}).params.max_tokens == 9


def test_chat_logprobs_mapping():
    assert chat_spec(chat(), {}).params.logprobs is None
    assert chat_spec(chat(logprobs=True), {}).params.logprobs == 0
    assert chat_spec(chat(logprobs=True, top_logprobs=3), {}).params.logprobs == 3
    assert error_of(chat_spec, chat(top_logprobs=2), {}).param == "top_logprobs"
    assert error_of(chat_spec, chat(logprobs=True, top_logprobs=21), {}).param == "top_logprobs"


def test_chat_messages_mapping():
    body = structure({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "x"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                     {"type": "text", "text": "what is it"}]},
    ]}, ChatCompletionRequest)
    messages = chat_spec(body, {}).messages
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1] == {"role": "user", "content": "a\nb", "name": "x"}
    assert messages[2]["content"][0] == {"type": "image_url", "image_url": {"url": "data:,", "detail": None}}
    bad_role = structure({"messages": [{"role": "robot", "content": "x"}]}, ChatCompletionRequest)
    assert error_of(chat_spec, bad_role, {}).param == "messages[0].role"
    no_text = structure({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, ChatCompletionRequest)
    assert error_of(chat_spec, no_text, {}).param == "messages[0].content[0]"


def test_chat_known_options_travel_in_extras():
    guided = chat_spec(chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}), {})
    assert guided.extras["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}
    assert chat_spec(chat(response_format={"type": "json_object"}), {}).extras["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in chat_spec(chat(response_format={"type": "text"}), {}).extras
    assert error_of(chat_spec, chat(response_format={"type": "yaml"}), {}).param == "response_format.type"
    assert chat_spec(chat(response_format={"type": "regex", "regex": "[ab]+"}), {}).extras["response_format"] == {
        "type": "regex", "regex": "[ab]+"}
    assert error_of(chat_spec, chat(response_format={"type": "grammar"}), {}).param == "response_format.grammar"
    audio = chat_spec(chat(modalities=["text", "audio"], audio={"voice": "v", "format": "wav"}), {})
    assert audio.extras["generate_audio"] is True and audio.extras["audio"] == {"voice": "v", "format": "wav"}
    assert "generate_audio" not in chat_spec(chat(modalities=["text"]), {}).extras
    assert error_of(chat_spec, chat(modalities=["video"]), {}).param == "modalities[0]"
    assert error_of(chat_spec, chat(tools=[{"type": "web", "function": {"name": "f"}}]), {}).param == "tools[0].type"
    assert chat_spec(chat(tool_choice="none", parallel_tool_calls=False), {}).messages


def test_round_trip_through_json():
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"], "seed": 1})
    body = parse_body(raw.encode(), ChatCompletionRequest)
    assert body.model == "m" and chat_spec(body, {}).params.stop == ("a",)
