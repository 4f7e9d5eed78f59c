"""Cross-site and size guards in front of every route: Host, Origin, Content-Type, body size.

A server on loopback with no API key must not be usable by web pages the
user happens to visit. Browsers send an ``Origin`` header on every
cross-origin POST, and a DNS-rebinding page reaches us under its own host
name, so both headers are checked before any route runs. JSON routes accept
only ``application/json`` bodies, which a page cannot send cross-origin
without a CORS preflight. Bodies are bounded: a declared ``Content-Length``
over the limit is refused at once, a chunked body as soon as it passes it.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable
from urllib.parse import urlsplit

import attrs
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ifb.server.errors import ApiError, api_error_response

#: 16 MiB: a prompt of a few million characters, far more than any context holds
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, without port) names this machine's loopback."""
    host = host.strip("[]").lower().rstrip(".")
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(value: str) -> str:
    """The host part of a ``Host`` header value (``name:port``, ``[v6]:port``), lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    return value.partition(":")[0].rstrip(".")


def _matches(host: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        pattern = pattern.lower()
        if pattern == "*" or pattern == host or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return False


@attrs.frozen
class GuardConfig:
    """What the guard lets through; ``ifb serve`` builds it from its flags."""

    #: check ``Host`` (on by default: right for a loopback bind)
    check_host: bool = True
    #: host names or ``*.suffix`` patterns allowed besides loopback ones (``*``: any)
    allowed_hosts: tuple[str, ...] = ()
    #: origins (``scheme://host[:port]``) other sites may call from (``*``: any)
    allowed_origins: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(--max-request-body-bytes)", code="request_too_large")


class Guard:
    """Pure ASGI middleware: refuses a request before the route reads a byte of its body."""

    def __init__(self, app: ASGIApp, config: GuardConfig, json_paths: frozenset[str] = frozenset()):
        self.app = app
        self.config = config
        #: routes that take JSON bodies; plugin routes declare their own content types
        self.json_paths = json_paths

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        config = self.config
        host = host_of(headers.get("host", ""))
        if config.check_host and not (is_loopback(host) or _matches(host, config.allowed_hosts)):
            return ApiError(403, f"the Host header {headers.get('host', '')!r} is not allowed: this server "
                                 "answers to loopback names only (add it with --allowed-hosts)",
                            code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, headers.get("host", "")):
            return ApiError(403, f"requests from the origin {origin!r} are not allowed "
                                 "(add it with --allowed-origins)", code="origin_not_allowed")
        method = scope["method"]
        if method in _BODY_METHODS and scope["path"] in self.json_paths:
            media = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media != "application/json":
                shown = media or "none"
                return ApiError(415, f"the request body must be JSON: send 'Content-Type: application/json' "
                                     f"(got {shown})", code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return ApiError(400, "the Content-Length header is not a number")
            if int(length) > config.max_request_body_bytes:
                return BodyTooLarge(config.max_request_body_bytes)
        return None

    def _origin_allowed(self, origin: str, host_header: str) -> bool:
        allowed = self.config.allowed_origins
        if "*" in allowed or origin in allowed:
            return True
        parts = urlsplit(origin)
        # same origin: a page served by this very server (its netloc is our Host header)
        return parts.scheme in ("http", "https") and bool(parts.netloc) \
            and parts.netloc.lower() == host_header.strip().lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await close_after(api_error_response(refusal, scope["path"]))(scope, receive, send)
            return
        limit = self.config.max_request_body_bytes
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, bounded, send)


def close_after(response):
    """``response`` with ``Connection: close``: after an error the client reconnects cleanly."""
    response.headers["connection"] = "close"
    return response
