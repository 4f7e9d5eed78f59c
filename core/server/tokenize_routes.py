"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes."""

from __future__ import annotations

from typing import Any

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ifb.params import InvalidRequest, RequestSpec
from ifb.server.convert import chat_request
from ifb.server.errors import ApiError
from ifb.server.schemas import ChatCompletionRequest, ChatMessage, Tool, parse_body
from ifb.server.state import AppState, check_prompt_length


@attrs.frozen
class TokenizeRequest:
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


@attrs.frozen
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


def _state(request: Request) -> AppState:
    return request.app.state.ifb


def _chat_ids(state: AppState, body: TokenizeRequest) -> list[int]:
    chat = ChatCompletionRequest(messages=body.messages or [], tools=body.tools)
    spec, _ = chat_request(chat, {}, template=state.chat_template, takes_media=state.takes_media)
    check_prompt_length(state.runtime, spec)
    tokenizer = state.runtime.tokenizer
    kwargs: dict[str, Any] = {"tools": spec.extras["tools"]} if "tools" in spec.extras else {}
    try:
        text = tokenizer.apply_chat_template(list(spec.messages), add_generation_prompt=body.add_generation_prompt,
                                             **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template's own error is the message
        raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc
    # the template writes any special tokens itself
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def _tokenize(state: AppState, body: TokenizeRequest) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt or messages")
    if body.prompt is not None:
        check_prompt_length(state.runtime, RequestSpec(prompt=body.prompt))
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = state.runtime.tokenizer.encode(body.prompt, add_special_tokens=add)
    else:
        ids = _chat_ids(state, body)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.runtime.max_model_len, "tokens": ids,
                           "token_strs": None}
    if body.return_token_strs:
        decode = state.runtime.tokenizer.decode
        out["token_strs"] = [decode([i], skip_special_tokens=False) for i in ids]
    return out


async def tokenize(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), TokenizeRequest)
    state.model_extras(body.model)
    try:
        return JSONResponse(await run_in_threadpool(_tokenize, state, body))
    except InvalidRequest as exc:
        raise ApiError(400, str(exc)) from None


async def detokenize(request: Request) -> Response:
    state = _state(request)
    body = parse_body(await request.body(), DetokenizeRequest)
    state.model_extras(body.model)
    vocab = getattr(state.runtime, "vocab_size", None) or getattr(state.runtime.tokenizer, "vocab_size", None)
    bad = next((t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary"
                            + (f" (0..{vocab - 1})" if vocab is not None else ""), param="tokens")
    text = await run_in_threadpool(state.runtime.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})


#: the JSON routes this module adds (the guard requires their Content-Type)
PATHS = ("/tokenize", "/detokenize")


def tokenize_routes() -> list[Route]:
    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
