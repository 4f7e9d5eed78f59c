"""LoRA adapters loaded and unloaded while serving: ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's names and bodies).

Admin routes: refused unless the server runs with an API key (``--api-key``), and then only with it. The
runtime's adapter registry (``runtime.lora``: ``load``, ``unload``, ``names``) does the work; a request
that holds an adapter being unloaded finishes with it.
"""

from __future__ import annotations

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ifb.server.errors import ApiError
from ifb.server.schemas import parse_body
from ifb.server.state import AppState


@attrs.frozen
class LoadLoraAdapter:
    lora_name: str
    lora_path: str


@attrs.frozen
class UnloadLoraAdapter:
    lora_name: str


def _registry(request: Request) -> tuple[AppState, object]:
    state: AppState = request.app.state.ifb
    if state.api_key is None:
        raise ApiError(403, "the admin routes need an API key: start the server with --api-key (or IFB_API_KEY)",
                       code="admin_disabled")
    state.check_auth(request)
    lora = getattr(state.runtime, "lora", None)
    if lora is None:
        raise ApiError(404, "this deployment serves no LoRA adapters", code="endpoint_not_served")
    return state, lora


async def load_lora_adapter(request: Request) -> Response:
    state, lora = _registry(request)
    body = parse_body(await request.body(), LoadLoraAdapter)
    if body.lora_name in (state.model_name, state.runtime.model_name):
        raise ApiError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
    try:
        await run_in_threadpool(lora.load, body.lora_name, body.lora_path)
    except (ValueError, OSError) as exc:  # a bad adapter: the message names the module or the file
        raise ApiError(400, str(exc), param="lora_path", code="invalid_adapter") from None
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": True})


async def unload_lora_adapter(request: Request) -> Response:
    _, lora = _registry(request)
    body = parse_body(await request.body(), UnloadLoraAdapter)
    try:
        lora.unload(body.lora_name)
    except KeyError as exc:
        raise ApiError(404, str(exc.args[0]), param="lora_name", code="model_not_found") from None
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": False})


def lora_routes() -> list[Route]:
    return [Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
