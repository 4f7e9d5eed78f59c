"""Request bodies of the OpenAI-compatible routes, parsed with one strict cattrs converter.

Unknown keys are errors, and values are never coerced (``"5"`` is not an
integer, ``1`` is not a string): a wrong type is a 400 naming the field.
Ranges are checked later by ``SamplingParams.validate``.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Union

import attrs
import cattrs
from cattrs.cols import list_structure_factory, mapping_structure_factory
from cattrs.gen import make_dict_structure_fn

from ifb.server.bodies import decode_json
from ifb.server.errors import ApiError

#: ``stop``: one string or a list of strings
Stop = Union[str, list[str], None]
#: ``prompt``: text, token ids, or a one-element list of either
Prompt = Union[str, list[int], list[str], list[list[int]]]


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen
class JsonSchema:
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


@attrs.frozen
class ResponseFormat:
    type: str  # text | json_object | json_schema | regex | grammar (the last two are ifb extensions)
    json_schema: JsonSchema | None = None
    regex: str | None = None
    grammar: str | None = None


@attrs.frozen
class ImageUrl:
    url: str
    detail: str | None = None


@attrs.frozen
class InputAudio:
    data: str
    format: str


@attrs.frozen
class ContentPart:
    type: str  # text | image_url | input_audio | trajectory (ifb: the past trajectory / robot state)
    text: str | None = None
    image_url: ImageUrl | None = None
    input_audio: InputAudio | None = None
    #: points oldest first, each a list of numbers; one point is the current state
    trajectory: list[list[float]] | None = None


@attrs.frozen
class FunctionCall:
    name: str
    arguments: str  # JSON text


@attrs.frozen
class ToolCallIn:
    """A tool call of an earlier assistant message."""

    function: FunctionCall
    id: str | None = None
    type: str = "function"


@attrs.frozen
class ChatMessage:
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    #: an earlier answer's thinking, as this server returned it (templates that render it get it back)
    reasoning_content: str | None = None


@attrs.frozen
class FunctionDef:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class Tool:
    type: str
    function: FunctionDef


@attrs.frozen
class FunctionName:
    name: str


@attrs.frozen
class NamedToolChoice:
    type: str
    function: FunctionName


@attrs.frozen
class AudioOutput:
    voice: str | None = None
    format: str | None = None


@attrs.frozen
class CompletionRequest:
    """``POST /v1/completions``. ``max_tokens`` defaults to 16, as OpenAI's does."""

    prompt: Prompt
    model: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: Stop = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    suffix: str | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM / llama.cpp extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # ifb: false keeps this request off speculative decoding where the deployment drafts
    speculative: bool = True


@attrs.frozen
class ChatCompletionRequest:
    """``POST /v1/chat/completions``. Without a limit the reply may fill the remaining context."""

    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stop: Stop = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: AudioOutput | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    # vLLM / llama.cpp extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # ifb: false keeps this request off speculative decoding where the deployment drafts
    speculative: bool = True
    # ifb: the seed of a trajectory plan's initial noise (with a trajectory content part)
    noise_seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- the converter ----

class _WrongType(TypeError):
    pass


def _describe(tp: Any) -> str:
    """A type in words, for error messages."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        words = [_describe(a) for a in args if a is not type(None)]
        text = " or ".join(dict.fromkeys(words))
        return f"{text} or null" if type(None) in args else text
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"a list of {_plural(item)}"
    if origin is dict or tp is dict:
        return "an object"
    if attrs.has(tp):
        return "an object"
    return {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}.get(tp, str(tp))


def _plural(tp: Any) -> str:
    words = _describe(tp)
    if words.startswith("a list of "):
        return "lists of " + words.removeprefix("a list of ")
    return {"an integer": "integers", "a string": "strings", "a number": "numbers",
            "an object": "objects", "a boolean": "booleans"}.get(words, words)


def _strict(check, tp: Any):
    def hook(value: Any, _: Any) -> Any:
        if not check(value):
            raise _WrongType(f"expected {_describe(tp)}")
        return float(value) if tp is float else value
    return hook


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json_kind(tp: Any) -> tuple[type, ...]:
    """The JSON values a type can be structured from."""
    origin = typing.get_origin(tp) or tp
    if origin is list:
        return (list,)
    if origin is dict or attrs.has(tp):
        return (dict,)
    if tp is float:
        return (int, float)
    if tp in (str, int, bool):
        return (tp,)
    return (object,)


def _union_hook(converter: cattrs.Converter, tp: Any):
    """Unions of JSON shapes (``str | list[str]``): the member that matches the value's JSON kind.

    When one member matches, its own (detailed) errors stand; when several do
    (lists of different items), each is tried in order.
    """
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    allows_none = type(None) in typing.get_args(tp)

    def hook(value: Any, _: Any) -> Any:
        if value is None and allows_none:
            return None
        candidates = [m for m in members if isinstance(value, _json_kind(m))
                      and not (isinstance(value, bool) and m in (int, float))]
        if len(candidates) == 1:
            return converter.structure(value, candidates[0])
        for member in candidates:
            try:
                return converter.structure(value, member)
            except Exception:  # noqa: BLE001 - try the next member
                continue
        raise _WrongType(f"expected {_describe(tp)}")
    return hook


def _is_json_union(tp: Any) -> bool:
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return False
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    # Optional[X] of one member keeps cattrs' own handling (and its detailed errors)
    return len(members) > 1


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(bool, _strict(lambda v: isinstance(v, bool), bool))
    converter.register_structure_hook(int, _strict(_is_int, int))
    converter.register_structure_hook(
        float, _strict(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), float))
    converter.register_structure_hook(str, _strict(lambda v: isinstance(v, str), str))
    converter.register_structure_hook(Any, lambda v, _: v)

    def checked(factory, kind: type):
        def make(tp: Any):
            inner = factory(tp, converter)

            def hook(value: Any, t: Any) -> Any:
                if not isinstance(value, kind):  # a string is iterable, but is not a list
                    raise _WrongType(f"expected {_describe(t)}")
                return inner(value, t)
            return hook
        return make

    def attrs_factory(cl: type):
        inner = make_dict_structure_fn(cl, converter, _cattrs_forbid_extra_keys=True)
        has_default = {f.name for f in attrs.fields(cl) if f.default is not attrs.NOTHING}

        def hook(value: Any, t: Any) -> Any:
            if isinstance(value, dict):  # many clients send null for "unset": it means the default
                value = {k: v for k, v in value.items() if v is not None or k not in has_default}
            return inner(value, t)
        return hook

    list_factory = checked(list_structure_factory, list)
    dict_factory = checked(mapping_structure_factory, dict)
    converter.register_structure_hook_factory(lambda t: typing.get_origin(t) is list, list_factory)
    converter.register_structure_hook_factory(lambda t: typing.get_origin(t) is dict, dict_factory)
    converter.register_structure_hook_factory(_is_json_union, lambda t: _union_hook(converter, t))
    converter.register_structure_hook_factory(attrs.has, attrs_factory)
    return converter


converter = _make_converter()


def _format(exc: BaseException, tp: Any) -> str:
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown field(s): {', '.join(sorted(exc.extra_fields))}"
    if isinstance(exc, _WrongType):
        return str(exc)
    if isinstance(exc, KeyError):
        return "this field is required"
    if tp is not None:
        if attrs.has(tp) and isinstance(exc, (TypeError, AttributeError)):
            return "expected an object"
        return f"expected {_describe(tp)}"
    return str(exc)


def _field_of(path: str) -> str | None:
    """``$.messages[0].role`` -> ``messages[0].role``; ``$`` -> None."""
    path = path.removeprefix("$").removeprefix(".")
    return path or None


def structure(data: Any, cls: type) -> Any:
    """Structure a decoded JSON body into ``cls``; raise ApiError(400) naming the field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return converter.structure(data, cls)
    except Exception as exc:  # noqa: BLE001 - every structuring failure is the client's
        messages = cattrs.transform_error(exc, path="$", format_exception=_format) \
            if isinstance(exc, cattrs.BaseValidationError) else [f"{_format(exc, cls)} @ $"]
        where = messages[0].rpartition(" @ ")[2]
        param = _field_of(where)
        parts = []
        for message in messages:
            text, _, at = message.rpartition(" @ ")
            field = _field_of(at)
            parts.append(f"{field}: {text}" if field else text)
        raise ApiError(400, "invalid request: " + "; ".join(parts), param=param) from None


def parse_body(raw: bytes, cls: type) -> Any:
    """Decode a JSON request body and structure it; raise ApiError(400) on any fault."""
    return structure(decode_json(raw), cls)
