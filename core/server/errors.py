"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

#: OpenAI's error ``type`` for each status we answer with
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


#: Anthropic's error ``type`` for each status (its Messages API's error shape)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

#: routes that answer errors in Anthropic's shape
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class ApiError(Exception):
    """An error a route answers with; the app turns it into an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type: str | None = None) -> JSONResponse:  # noqa: A002
    """A JSONResponse carrying an OpenAI-shaped error."""
    return api_error_response(ApiError(status, message, param=param, code=code, type=type))


def api_error_response(error: ApiError, path: str | None = None) -> JSONResponse:
    """The error as a response, in Anthropic's shape on its routes (``path``), else OpenAI's."""
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
    if error.status == 413 or error.status >= 500:
        # the rest of the body is unread (413) or the connection's state is unknown (5xx): the
        # client must open a new connection rather than find this one reset
        headers["Connection"] = "close"
    body = error.anthropic_body() if path is not None and is_anthropic_path(path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=headers or None)


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return api_error_response(exc, request.url.path)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 / 405 answers, in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or "error"
    if status == 404:
        detail = f"no route for {request.method} {request.url.path}"
    elif status == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
    return api_error_response(ApiError(status, str(detail)), request.url.path)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """The last resort: an unexpected fault is a 500 with its message, never a stack trace."""
    return api_error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)
