"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages body is converted into a chat completions request (the same
``chat_request`` conversion, tool plan, guided decoding and reasoning split)
and answered through the same generation path; only the rendering differs
(``anthropic_render``). Errors on these routes are in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``), and ``x-api-key`` is
accepted besides ``Authorization: Bearer`` when the server has a key.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ifb.params import InvalidRequest
from ifb.server.anthropic_render import MessagesRenderer, message_id
from ifb.server.anthropic_schemas import (
    CountTokensRequest, ImageBlock, MessagesRequest, TextBlock, ThinkingBlockIn, ThinkingConfig, ToolChoice,
    ToolDef, ToolResultBlock, ToolUseBlock, structure_block,
)
from ifb.server.convert import chat_request
from ifb.server.errors import ApiError
from ifb.server.reasoning import ThinkingChoice
from ifb.server.schemas import (
    ChatCompletionRequest, ChatMessage, ContentPart, FunctionCall, FunctionDef, FunctionName, ImageUrl,
    JsonSchema, NamedToolChoice, ResponseFormat, Tool, ToolCallIn, parse_body,
)
from ifb.server.state import check_prompt_length


def _system(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [ChatMessage(role="system", content=text)] if text else []


def _image(block: ImageBlock, where: str) -> ContentPart:
    source = block.source
    if source.type == "base64" and source.data and source.media_type:
        url = f"data:{source.media_type};base64,{source.data}"
    elif source.type == "url" and source.url:
        url = source.url
    else:
        raise ApiError(400, "an image source is base64 (media_type and data) or url (url)", param=f"{where}.source")
    return ContentPart(type="image_url", image_url=ImageUrl(url=url))


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for j, raw in enumerate(block.content):
        inner = structure_block(raw, f"{where}.content[{j}]")
        if not isinstance(inner, TextBlock):
            raise ApiError(400, "a tool_result's content holds text blocks only here", param=f"{where}.content[{j}]")
        texts.append(inner.text)
    return "\n".join(texts)


def _messages(body: MessagesRequest | CountTokensRequest) -> list[ChatMessage]:
    out = _system(body.system)
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if message.role not in ("user", "assistant"):
            raise ApiError(400, f"unsupported role {message.role!r} (user or assistant; the system prompt is the "
                                "system field)", param=f"{where}.role")
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
            continue
        parts: list[ContentPart] = []
        calls: list[ToolCallIn] = []
        results: list[ChatMessage] = []
        for j, raw in enumerate(message.content):
            at = f"{where}.content[{j}]"
            block = structure_block(raw, at)
            if isinstance(block, TextBlock):
                parts.append(ContentPart(type="text", text=block.text))
            elif isinstance(block, ImageBlock):
                parts.append(_image(block, at))
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise ApiError(400, "tool_use blocks belong to assistant messages", param=at)
                calls.append(ToolCallIn(function=FunctionCall(name=block.name, arguments=json.dumps(block.input)),
                                        id=block.id))
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise ApiError(400, "tool_result blocks belong to user messages", param=at)
                results.append(ChatMessage(role="tool", content=_tool_result_text(block, at),
                                           tool_call_id=block.tool_use_id))
            elif isinstance(block, ThinkingBlockIn):
                continue
        out.extend(results)
        if calls:
            text = "\n".join(p.text or "" for p in parts if p.type == "text") or None
            out.append(ChatMessage(role="assistant", content=text, tool_calls=calls))
        elif parts or not results:
            if not parts:
                raise ApiError(400, f"{where}.content is empty", param=f"{where}.content")
            out.append(ChatMessage(role=message.role, content=parts))
    if len(out) == len(_system(body.system)):
        raise ApiError(400, "messages must not be empty", param="messages")
    return out


def _tools(tools: list[ToolDef] | None, choice: ToolChoice | None) -> tuple[list[Tool] | None, Any, bool | None]:
    converted = None
    if tools is not None:
        converted = []
        for i, tool in enumerate(tools):
            if tool.type not in (None, "custom"):
                raise ApiError(400, f"server tool {tool.type!r} is not supported: this server runs client tools "
                                    "(name, description, input_schema) only", param=f"tools[{i}].type")
            converted.append(Tool(type="function", function=FunctionDef(
                name=tool.name, description=tool.description, parameters=tool.input_schema or {"type": "object"})))
    if choice is None:
        return converted, None, None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    words = {"auto": "auto", "any": "required", "none": "none"}
    if choice.type in words:
        return converted, words[choice.type], parallel
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice of type tool needs a name", param="tool_choice.name")
        return converted, NamedToolChoice(type="function", function=FunctionName(name=choice.name)), parallel
    raise ApiError(400, f"unknown tool_choice type {choice.type!r} (auto, any, tool or none)", param="tool_choice.type")


def _thinking(config: ThinkingConfig | None) -> ThinkingChoice:
    if config is None:
        return ThinkingChoice()
    if config.type not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, f"unknown thinking type {config.type!r} (enabled, disabled or adaptive)",
                       param="thinking.type")
    return ThinkingChoice(enabled=config.type != "disabled")


def _format(body: MessagesRequest) -> ResponseFormat | None:
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema" or fmt.schema is None:
        raise ApiError(400, "output_config.format is a json_schema with a schema", param="output_config.format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchema(name="output", schema=fmt.schema))


def _chat(body: MessagesRequest | CountTokensRequest, **sampling: Any) -> ChatCompletionRequest:
    tools, choice, parallel = _tools(body.tools, body.tool_choice)
    return ChatCompletionRequest(messages=_messages(body), model=body.model, tools=tools, tool_choice=choice,
                                 parallel_tool_calls=parallel, **sampling)


async def create_message(request: Request) -> Response:
    from ifb.server.openai_routes import app_state, generate

    state = app_state(request)
    state.require_endpoint("chat.completions", "/v1/messages")
    body = parse_body(await request.body(), MessagesRequest)
    chat = _chat(body, max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, response_format=_format(body))
    spec, plan = chat_request(chat, state.model_extras(body.model), template=state.chat_template,
                              takes_media=state.takes_media, reasoning=state.reasoning,
                              choice=_thinking(body.thinking))
    renderer = MessagesRenderer(message_id(), body.model or state.model_name, tools=plan, thinking=spec.thinking)
    return await generate(request, state, spec, renderer)


async def count_tokens(request: Request) -> Response:
    from ifb.server.openai_routes import app_state

    state = app_state(request)
    state.require_endpoint("chat.completions", "/v1/messages/count_tokens")
    body = parse_body(await request.body(), CountTokensRequest)
    spec, _ = chat_request(_chat(body), state.model_extras(body.model), template=state.chat_template,
                           takes_media=state.takes_media, reasoning=state.reasoning, choice=_thinking(body.thinking))

    def count() -> int:
        check_prompt_length(state.runtime, spec)
        return len(state.runtime.prepare(spec).prompt_token_ids)

    try:
        return JSONResponse({"input_tokens": await run_in_threadpool(count)})
    except InvalidRequest as exc:
        raise ApiError(400, str(exc)) from None


def anthropic_routes() -> list[Route]:
    return [Route("/v1/messages", create_message, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
