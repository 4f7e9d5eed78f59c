"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A Responses body is converted into a chat completions request (the same
``chat_request`` conversion, tool plan, guided decoding and reasoning split)
and answered through the same generation path; only the rendering differs
(``responses_render``). Stored responses (``store``, the default) are kept in
memory, the newest ``MAX_STORED_RESPONSES`` of them, with the conversation
that produced them, so ``previous_response_id`` continues it; they are lost
when the server stops.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ifb.server.convert import chat_request
from ifb.server.errors import ApiError
from ifb.server.reasoning import effort_choice
from ifb.server.responses_render import ResponsesRenderer, envelope
from ifb.server.responses_schemas import (
    FunctionCallItem, FunctionCallOutputItem, InputPart, MessageItem, ReasoningItem, ResponsesRequest,
    converter, structure_item,
)
from ifb.server.schemas import (
    ChatCompletionRequest, ChatMessage, ContentPart, FunctionCall, FunctionDef, FunctionName, ImageUrl,
    JsonSchema, NamedToolChoice, ResponseFormat, Tool, ToolCallIn, parse_body,
)

#: stored responses kept (oldest dropped first); each holds its conversation, so memory stays bounded
MAX_STORED_RESPONSES = 1000
_INCLUDES = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})


@attrs.define
class ResponseStore:
    """The newest ``limit`` stored responses, with the chat messages that continue each."""

    limit: int = MAX_STORED_RESPONSES
    _items: OrderedDict = attrs.field(factory=OrderedDict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def put(self, response: dict[str, Any], messages: list[ChatMessage]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, messages)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[ChatMessage]] | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if not hasattr(state, "responses"):
        state.responses = ResponseStore()
    return state.responses


# ---- input -> chat messages ----

def _parts(content: str | list[InputPart], where: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if part.type in ("input_text", "output_text"):
            if part.text is None:
                raise ApiError(400, f"a content part of type {part.type} needs text", param=at)
            parts.append(ContentPart(type="text", text=part.text))
        elif part.type == "refusal":
            parts.append(ContentPart(type="text", text=part.refusal or ""))
        elif part.type == "input_image":
            if not part.image_url:
                raise ApiError(400, "an input_image part needs an image_url (a URL or a data: URL); file_id is "
                                    "not supported", param=at)
            parts.append(ContentPart(type="image_url", image_url=ImageUrl(url=part.image_url, detail=part.detail)))
        else:
            raise ApiError(400, f"unsupported content part type {part.type!r} (input_text, input_image, "
                                "output_text or refusal)", param=f"{at}.type")
    return parts


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The request's ``input`` as chat messages (function calls join the assistant turn they belong to)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    messages: list[ChatMessage] = []
    for i, raw in enumerate(body.input):
        item = structure_item(raw, i)
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, MessageItem):
            if item.role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"unsupported role {item.role!r} (user, assistant, system or developer)",
                               param=f"input[{i}].role")
            messages.append(ChatMessage(role=item.role, content=_parts(item.content, f"input[{i}]")))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(function=FunctionCall(name=item.name, arguments=item.arguments), id=item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and not isinstance(last.content, list):
                messages[-1] = attrs.evolve(last, tool_calls=[*(last.tool_calls or []), call])
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else \
                "\n".join(p.text or "" for p in item.output if p.type in ("input_text", "output_text"))
            messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
    if not messages:
        raise ApiError(400, "input has no messages", param="input")
    return messages


def output_messages(response: dict[str, Any]) -> list[ChatMessage]:
    """A finished response's output as the assistant turn a later request continues."""
    text, calls = None, []
    for item in response["output"]:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            calls.append(ToolCallIn(function=FunctionCall(name=item["name"], arguments=item["arguments"]),
                                    id=item["call_id"]))
    return [ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)]


# ---- the rest of the body ----

def _tools(body: ResponsesRequest) -> tuple[list[Tool] | None, Any]:
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.type != "function":
                raise ApiError(400, f"unsupported tool type {tool.type!r}: this server runs function tools only",
                               param=f"tools[{i}].type")
            if not tool.name:
                raise ApiError(400, "a function tool needs a name", param=f"tools[{i}].name")
            tools.append(Tool(type="function", function=FunctionDef(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict)))
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function" or not choice.name:
            raise ApiError(400, f"unsupported tool_choice type {choice.type!r} (a function, with its name)",
                           param="tool_choice.type")
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return tools, choice


def _format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.name is None or fmt.schema is None:
            raise ApiError(400, "text.format of type json_schema needs a name and a schema", param="text.format")
        return ResponseFormat(type="json_schema", json_schema=JsonSchema(
            name=fmt.name, schema=fmt.schema, description=fmt.description, strict=fmt.strict))
    raise ApiError(400, f"unknown text.format type {fmt.type!r} (text, json_object or json_schema)",
                   param="text.format.type")


def _checks(body: ResponsesRequest) -> None:
    if body.background:
        raise ApiError(400, "background responses are not supported by this server", param="background")
    if body.truncation not in (None, "disabled"):
        raise ApiError(400, "truncation 'auto' is not supported: a prompt past the context is refused",
                       param="truncation")
    unknown = sorted(set(body.include or ()) - _INCLUDES)
    if unknown:
        raise ApiError(400, f"include values not supported: {', '.join(unknown)}", param="include")


def _settings(body: ResponsesRequest, previous: str | None) -> dict[str, Any]:
    """The request's fields a response object echoes."""
    fmt = converter.unstructure(body.text.format) if body.text and body.text.format else {"type": "text"}
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tools": [converter.unstructure(t) for t in body.tools or ()],
        "tool_choice": converter.unstructure(body.tool_choice) if body.tool_choice is not None else "auto",
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "text": {"format": {k: v for k, v in fmt.items() if v is not None}},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "previous_response_id": previous, "store": body.store, "metadata": body.metadata or {},
        "truncation": "disabled", "user": body.user, "background": False,
    }


async def create_response(request: Request) -> Response:
    from ifb.server.openai_routes import app_state, generate

    state = app_state(request)
    state.require_endpoint("chat.completions", "/v1/responses")
    body = parse_body(await request.body(), ResponsesRequest)
    _checks(body)
    store = _store(request)
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        found = store.get(body.previous_response_id)
        if found is None:
            raise ApiError(400, f"previous response {body.previous_response_id!r} was not found (this server keeps "
                                f"the newest {store.limit} stored responses in memory)", param="previous_response_id")
        previous, previous_messages = found
        history = [*previous_messages, *output_messages(previous)]
    new = input_messages(body)
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    tools, choice = _tools(body)
    chat = ChatCompletionRequest(
        messages=[*system, *history, *new], model=body.model, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, response_format=_format(body),
        tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls, top_k=body.top_k,
        seed=body.seed, chat_template_kwargs=body.chat_template_kwargs)
    effort = effort_choice(body.reasoning.effort if body.reasoning else None, "reasoning.effort")
    spec, plan = chat_request(chat, state.model_extras(body.model), template=state.chat_template,
                              takes_media=state.takes_media, reasoning=state.reasoning, choice=effort)
    response_id = f"resp_{uuid.uuid4().hex}"
    conversation = [*history, *new]

    def keep(response: dict[str, Any]) -> None:
        if body.store:
            store.put(response, conversation)

    renderer = ResponsesRenderer(envelope(response_id, body.model or state.model_name,
                                          _settings(body, body.previous_response_id)),
                                 tools=plan, thinking=spec.thinking, on_done=keep)
    return await generate(request, state, spec, renderer)


async def retrieve_response(request: Request) -> Response:
    found = _store(request).get(request.path_params["response_id"])
    if found is None:
        raise ApiError(404, f"no stored response {request.path_params['response_id']!r}", param="response_id")
    return JSONResponse(found[0])


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not _store(request).delete(response_id):
        raise ApiError(404, f"no stored response {response_id!r}", param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def responses_routes() -> list[Route]:
    return [Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])]
