"""Request bodies of the Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Content blocks are structured by their ``type``, each with its own strict
class, so an unknown field of any block is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Union

import attrs

from ifb.server.errors import ApiError


@attrs.frozen
class ImageSource:
    type: str  # base64 | url
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


@attrs.frozen
class TextBlock:
    type: str
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


@attrs.frozen
class ImageBlock:
    type: str
    source: ImageSource
    cache_control: dict[str, Any] | None = None


@attrs.frozen
class ToolUseBlock:
    type: str
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


@attrs.frozen
class ToolResultBlock:
    type: str
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


@attrs.frozen
class ThinkingBlockIn:
    """An earlier turn's thinking: accepted and dropped (templates render past turns without it)."""

    type: str
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking


Block = Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlockIn]
_BLOCK_TYPES = {"text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                "thinking": ThinkingBlockIn, "redacted_thinking": ThinkingBlockIn}


@attrs.frozen
class Message:
    role: str
    content: str | list[dict[str, Any]]


@attrs.frozen
class ToolDef:
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; server tools are refused
    cache_control: dict[str, Any] | None = None


@attrs.frozen
class ToolChoice:
    type: str  # auto | any | tool | none
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class ThinkingConfig:
    type: str  # enabled | disabled | adaptive
    budget_tokens: int | None = None
    display: str | None = None


@attrs.frozen
class OutputFormat:
    type: str  # json_schema
    schema: dict[str, Any] | None = None


@attrs.frozen
class OutputConfig:
    effort: str | None = None
    format: OutputFormat | None = None


@attrs.frozen
class Metadata:
    user_id: str | None = None


@attrs.frozen
class MessagesRequest:
    """``POST /v1/messages``: ``max_tokens`` is required, as Anthropic's API has it."""

    max_tokens: int
    messages: list[Message]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None


@attrs.frozen
class CountTokensRequest:
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages body."""

    messages: list[Message]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


def structure_block(raw: Any, where: str) -> Block:
    """One content block as its class; 400 naming ``where`` when it is not one."""
    from ifb.server.schemas import structure

    if not isinstance(raw, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    kind = raw.get("type")
    cls = _BLOCK_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ApiError(400, f"{where} has the unsupported type {kind!r} (text, image, tool_use, tool_result "
                            "or thinking)", param=f"{where}.type")
    try:
        return structure(raw, cls)
    except ApiError as exc:
        param = f"{where}.{exc.param}" if exc.param else where
        raise ApiError(400, exc.message.replace("invalid request: ", f"invalid request: {where}."), param=param) \
            from None
