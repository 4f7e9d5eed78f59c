"""Request bodies of the OpenAI Responses API (``POST /v1/responses``), for the strict converter.

Input items are structured by their ``type`` (``message`` when absent), each
with its own strict class, so an unknown field of any item is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Union

import attrs

from ifb.server.errors import ApiError
from ifb.server.schemas import converter


@attrs.frozen
class InputPart:
    """A content part of an input message: ``input_text``, ``input_image``, ``output_text``, ``refusal``."""

    type: str
    text: str | None = None
    image_url: str | None = None
    detail: str | None = None
    file_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


@attrs.frozen
class MessageItem:
    role: str
    content: str | list[InputPart]
    type: str = "message"
    id: str | None = None
    status: str | None = None


@attrs.frozen
class FunctionCallItem:
    type: str  # function_call
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


@attrs.frozen
class FunctionCallOutputItem:
    type: str  # function_call_output
    call_id: str
    output: str | list[InputPart]
    id: str | None = None
    status: str | None = None


@attrs.frozen
class ReasoningText:
    type: str
    text: str


@attrs.frozen
class ReasoningItem:
    """An earlier turn's reasoning: accepted and dropped (templates render past turns without it)."""

    type: str  # reasoning
    id: str | None = None
    summary: list[ReasoningText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
_ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
               "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


@attrs.frozen
class FunctionTool:
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class NamedFunction:
    type: str
    name: str | None = None


@attrs.frozen
class TextFormat:
    type: str  # text | json_schema | json_object
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


@attrs.frozen
class TextConfig:
    format: TextFormat | None = None
    verbosity: str | None = None


@attrs.frozen
class ReasoningConfig:
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


@attrs.frozen
class ResponsesRequest:
    """``POST /v1/responses``. ``store`` defaults to true, as OpenAI's does."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    # the engine's own sampling fields, as on chat completions
    top_k: int | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def structure_item(raw: Any, index: int) -> InputItem:
    """One ``input`` item as its class; 400 naming ``input[index]`` when it is not one."""
    from ifb.server.schemas import structure

    where = f"input[{index}]"
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    kind = raw.get("type", "message")
    cls = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ApiError(400, f"{where} has the unsupported type {kind!r} (message, function_call, "
                            "function_call_output or reasoning)", param=f"{where}.type")
    try:
        return structure(raw, cls)
    except ApiError as exc:
        param = f"{where}.{exc.param}" if exc.param else where
        raise ApiError(400, exc.message.replace("invalid request: ", f"invalid request: {where}."), param=param) \
            from None


__all__ = ["ResponsesRequest", "converter", "structure_item"]
