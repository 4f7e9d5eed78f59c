"""``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``.

A request is submitted (tokenization in a worker thread), then the handler
waits for its first output before answering, so admission failures (a queue
time-out on the blocking path, a failed step) still get a proper status. While
waiting, and while streaming, a client that disconnects cancels its request
inside the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ifb.outputs import QUEUE_TIMEOUT, RequestHandle, RequestOutput
from ifb.params import RequestSpec
from ifb.server.convert import chat_request, completion_spec
from ifb.server.errors import ApiError
from ifb.server.metrics import RequestTimer
from ifb.server.render import ChatRenderer, Collected, CompletionRenderer, Renderer
from ifb.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from ifb.server.state import AppState
from ifb.server.tools import ToolPlan

T = TypeVar("T")


def app_state(request: Request) -> AppState:
    return request.app.state.ifb


# ---- disconnect watching ----

async def _watch(receive: Receive, handle: RequestHandle, scope: anyio.CancelScope) -> None:
    """Cancel ``handle`` (and ``scope``) when the client disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            scope.cancel()
            return


async def until_disconnect(request: Request, handle: RequestHandle,
                           work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run ``work`` while watching the client; returns (client still there, result).

    ``work``'s own exceptions propagate as they are (not wrapped in a group).
    """
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as group:
        group.start_soon(_watch, request.receive, handle, group.cancel_scope)
        try:
            outcome["value"] = await work()
        except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
            outcome["error"] = exc
        group.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return "value" in outcome, outcome.get("value")


def engine_error(out: RequestOutput, default: str = "the request failed") -> ApiError:
    """The error a request the engine failed answers with (before anything was sent): 429 for one that
    timed out in the queue (back-pressure), else 500."""
    if out.error_code == QUEUE_TIMEOUT:
        return ApiError(429, out.error or default, code="engine_full")
    return ApiError(500, out.error or default)


def _sse(data: dict[str, Any] | str | tuple[str, dict[str, Any]]) -> bytes:
    """One server-sent event: ``data:`` only, or with an ``event:`` line for a (name, data) pair."""
    head = ""
    if isinstance(data, tuple):
        head, data = f"event: {data[0]}\n", data[1]
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}data: {text}\n\n".encode()


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that cancels its request when the client leaves.

    It listens for ``http.disconnect`` itself and treats a failed send as one,
    whatever ASGI spec version the server speaks.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], handle: RequestHandle):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_watch, receive, self._handle, group.cancel_scope)
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for event in self._events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()
        except* OSError:  # the client went away mid-send (servers speaking ASGI 2.4 raise)
            pass
        finally:
            if not self._handle.done.is_set():
                self._handle.cancel()
            await self._events.aclose()


# ---- generation ----

@attrs.frozen
class _Kind:
    endpoint: str
    path: str
    schema: type
    id_prefix: str


COMPLETIONS = _Kind("completions", "/v1/completions", CompletionRequest, "cmpl")
CHAT = _Kind("chat.completions", "/v1/chat/completions", ChatCompletionRequest, "chatcmpl")


def _renderer(kind: _Kind, body: Any, state: AppState, spec: RequestSpec, tools: ToolPlan | None,
              echo: str | None) -> Renderer:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    args = (f"{kind.id_prefix}-{uuid.uuid4().hex}", body.model or state.model_name, int(time.time()))
    common = dict(num_choices=spec.params.n, include_usage=include_usage,
                  system_fingerprint=state.system_fingerprint)
    if kind is CHAT:
        return ChatRenderer(*args, wants_logprobs=body.logprobs, tools=tools, thinking=spec.thinking, **common)
    return CompletionRenderer(*args, echo=echo, **common)


def _echo_text(state: AppState, body: Any, spec: Any) -> str | None:
    if not getattr(body, "echo", False):
        return None
    if spec.prompt is not None:
        return spec.prompt
    return state.runtime.tokenizer.decode(list(spec.prompt_token_ids), skip_special_tokens=False)


async def read_body(request: Request, schema: type) -> Any:
    """The request's JSON body as ``schema`` (400 naming the field; 413 past the size limit)."""
    return parse_body(await request.body(), schema)


async def _generate(request: Request, kind: _Kind) -> Response:
    state = app_state(request)
    state.require_endpoint(kind.endpoint, kind.path)
    body = await read_body(request, kind.schema)
    extras = state.model_extras(body.model)
    tools = None
    if kind is CHAT:
        spec, tools = chat_request(body, extras, template=state.chat_template, takes_media=state.takes_media,
                                   reasoning=state.reasoning)
    else:
        spec = completion_spec(body, extras)
    echo = _echo_text(state, body, spec)
    return await generate(request, state, spec, _renderer(kind, body, state, spec, tools, echo))


async def generate(request: Request, state: AppState, spec: RequestSpec, renderer: Renderer) -> Response:
    """Submit ``spec`` and answer with what ``renderer`` makes of its outputs (streamed when ``spec.stream``).

    The Responses and Messages routes answer through this too, with their own renderers.
    """
    timer = state.metrics.timer()
    handle = await state.submit(spec)
    try:
        return await _answer(request, spec.stream, renderer, handle, timer)
    except BaseException:
        # an error answer, or the server stopping: nobody will read this request any more
        if not handle.done.is_set():
            handle.cancel()
        timer.finish()
        raise


async def _answer(request: Request, stream: bool, renderer: Renderer, handle: RequestHandle,
                  timer: RequestTimer) -> Response:
    outputs = handle.__aiter__()
    try:
        present, first = await until_disconnect(request, handle, outputs.__anext__)
    except StopAsyncIteration:
        present, first = True, None
    if not present or first is None:
        timer.finish()
        return Response(status_code=499)  # nobody is listening; the request is cancelled
    timer.observe(first)
    if first.finish_reason == "error":
        raise engine_error(first)
    if stream:
        return EventStream(_stream(renderer, first, outputs, handle, timer), handle)
    return await _complete(request, renderer, first, outputs, handle, timer)


async def _complete(request: Request, renderer: Renderer, first: RequestOutput,
                    outputs: AsyncIterator[RequestOutput], handle: RequestHandle,
                    timer: RequestTimer) -> Response:
    collected = Collected()
    collected.add(first)

    async def rest() -> None:
        async for out in outputs:
            timer.observe(out)
            collected.add(out)
            if out.finish_reason == "error":
                raise engine_error(out)

    try:
        if not first.finished:
            present, _ = await until_disconnect(request, handle, rest)
            if not present:
                return Response(status_code=499)
    finally:
        timer.finish()
    body = renderer.full(collected)
    return body if isinstance(body, Response) else JSONResponse(body)


async def _stream(renderer: Renderer, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                  handle: RequestHandle, timer: RequestTimer) -> AsyncGenerator[bytes, None]:
    collected = Collected()
    try:
        for chunk in renderer.opening():
            yield _sse(chunk)
        out: RequestOutput | None = first
        while out is not None:
            if out.finish_reason == "error":
                yield _sse(renderer.error_event(engine_error(out)))
                handle.cancel()
                break
            for chunk in renderer.delta(out, collected.add(out)):
                yield _sse(chunk)
            if out.finished:
                for chunk in renderer.closing(collected):
                    yield _sse(chunk)
                break
            out = await anext(outputs, None)
            if out is not None:
                timer.observe(out)
        if renderer.done_marker is not None:
            yield _sse(renderer.done_marker)
    finally:
        timer.finish()


async def completions(request: Request) -> Response:
    return await _generate(request, COMPLETIONS)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT)


def _model_cards(state: AppState) -> list[dict[str, Any]]:
    declared = state.deployment.caps.endpoints or ("completions", "chat.completions")
    served = [name for name in declared if state.serves_endpoint(name)]
    capabilities = {
        "in_flight_batching": state.is_in_flight,
        "max_num_seqs": state.deployment.config.max_batch_size if state.is_in_flight else 1,
        "endpoints": served,
        "request_options": state.option_statuses(),
    }
    base = {"object": "model", "created": state.created, "owned_by": "ifb",
            "max_model_len": state.runtime.max_model_len}
    data = [{"id": state.model_name, **base, "root": state.model_name, "parent": None,
             "plugin": state.deployment.kind.plugin, "capabilities": capabilities}]
    for name in state.lora_names:
        data.append({"id": name, **base, "root": name, "parent": state.model_name,
                     "plugin": state.deployment.kind.plugin, "capabilities": capabilities})
    return data


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": _model_cards(app_state(request))})


async def retrieve_model(request: Request) -> Response:
    state = app_state(request)
    model = request.path_params["model"]
    for card in _model_cards(state):
        if card["id"] == model:
            return JSONResponse(card)
    served = ", ".join(card["id"] for card in _model_cards(state))
    raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", param="model",
                   code="model_not_found")


def openai_routes() -> list[Route]:
    from ifb.server.anthropic import anthropic_routes
    from ifb.server.responses import responses_routes
    from ifb.server.tokenize_routes import tokenize_routes
    from ifb.server.transcriptions import transcription_routes

    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        *responses_routes(),
        *anthropic_routes(),
        *transcription_routes(),
        *tokenize_routes(),
    ]
