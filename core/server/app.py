"""The ASGI application: OpenAI-compatible routes, ``/health``, ``/metrics`` and plugin routes."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ifb.plugins import PluginHost, default_host
from ifb.server.errors import ApiError, api_error_response, handle_api_error, handle_http_exception, \
    handle_unexpected
from ifb.server.guard import Guard, GuardConfig
from ifb.server.metrics import ServerMetrics
from ifb.server.lora_routes import lora_routes
from ifb.server.openai_routes import app_state, openai_routes
from ifb.server.reasoning import Reasoning, detect
from ifb.server.state import AppState

log = logging.getLogger("ifb.server")

#: routes reachable without the API key (load balancers probe it)
PUBLIC_PATHS = frozenset({"/health"})


class BearerAuth:
    """Every route but ``/health`` needs ``Authorization: Bearer <key>`` when a key is set."""

    def __init__(self, app: ASGIApp, state: AppState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            try:
                self.state.check_auth(Request(scope))
            except ApiError as exc:
                await api_error_response(exc, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def health(request: Request) -> Response:
    state = app_state(request)
    return JSONResponse({"status": "ok", "model": state.model_name, **state.engine.health()})


async def metrics(request: Request) -> Response:
    body = app_state(request).metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _plugin_routes(host: PluginHost, state: AppState) -> list[BaseRoute]:
    routes: list[BaseRoute] = []
    for group in host.hook.ifb_http_routes(app_state=state):
        for route in group or ():
            if not isinstance(route, BaseRoute):
                raise TypeError(f"ifb_http_routes returned {route!r}, not a Starlette route")
            routes.append(route)
    return routes


#: POST routes whose bodies are multipart uploads, not JSON
MULTIPART_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})


def _json_paths(routes: list[BaseRoute]) -> frozenset[str]:
    return frozenset(r.path for r in routes if isinstance(r, Route) and "POST" in (r.methods or ())
                     and r.path not in MULTIPART_PATHS)


def _reasoning(deployment, choice: str) -> Reasoning:
    tokenizer = deployment.runtime.tokenizer
    template = getattr(tokenizer, "chat_template", None)

    def render(kwargs: dict) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             **kwargs)

    return detect(choice, template if isinstance(template, str) else None, render)


def build_app(deployment, *, api_key: str | None = None, model_name: str | None = None,
              host: PluginHost | None = None, guard: GuardConfig | None = None,
              reasoning_parser: str = "auto") -> Starlette:
    """The server for one loaded ``Deployment``.

    ``model_name`` is the name ``/v1/models`` lists and requests may use
    (default: the runtime's). With ``api_key`` every route but ``/health``
    requires ``Authorization: Bearer <api_key>``. Plugins add routes through
    the ``ifb_http_routes`` hook, which receives the ``AppState``. ``guard``
    bounds bodies and keeps other sites out (default: loopback ``Host`` names
    only, no foreign ``Origin``, 16 MiB bodies); POST routes take JSON only.
    ``reasoning_parser`` splits thinking from answers (``ifb.server.reasoning``).
    """
    guard = guard or GuardConfig()
    name = model_name or deployment.runtime.model_name
    state = AppState(deployment=deployment, model_name=name, metrics=ServerMetrics(deployment.engine, name),
                     api_key=api_key, reasoning=_reasoning(deployment, reasoning_parser))
    routes: list[BaseRoute] = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai_routes(),
        *lora_routes(),
    ]
    extra = _plugin_routes(host or default_host(), state)
    if extra:
        log.info("plugin routes: %s", ", ".join(getattr(r, "path", repr(r)) for r in extra))
    app = Starlette(
        routes=[*routes, *extra],
        exception_handlers={ApiError: handle_api_error, HTTPException: handle_http_exception,
                            Exception: handle_unexpected},
    )
    app.state.ifb = state
    app.state.guard = guard
    # the last added runs first: CORS answers preflights, the guard refuses before auth is asked
    app.add_middleware(BearerAuth, state=state)
    app.add_middleware(Guard, config=guard, json_paths=_json_paths([*routes, *extra]))
    if guard.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(guard.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
