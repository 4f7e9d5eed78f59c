"""``POST /v1/audio/speech`` (OpenAI's text-to-speech endpoint) for speech deployments.

Body: OpenAI's ``{"model", "input", "voice", "instructions", "response_format", "speed",
"stream_format"}`` plus Qwen3-TTS's ``language`` and a ``seed``. The answer is the
audio itself, streamed as OpenAI streams it: with ``stream_format: "audio"``
(the default) the container's bytes go out in chunked transfer as their codes
are decoded; with ``"sse"`` as server-sent events ``speech.audio.delta``
(base64 audio) and a closing ``speech.audio.done`` with the usage.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, AsyncGenerator

import attrs
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb.server.errors import ApiError
from ifb.server.openai_routes import EventStream, engine_error
from ifb.server.schemas import parse_body
from ifb_plugins.speech import audio

log = logging.getLogger("ifb.speech")

ENDPOINT = "audio.speech"
PATH = "/v1/audio/speech"
#: OpenAI's limit on ``input``
MAX_INPUT_CHARS = 4096
STREAM_FORMATS = ("audio", "sse")


@attrs.frozen
class SpeechBody:
    """OpenAI's ``POST /v1/audio/speech`` body, with Qwen3-TTS's ``language``."""

    input: str
    model: str | None = None
    voice: str | None = None
    instructions: str | None = None
    response_format: str | None = None
    speed: float | None = None
    stream_format: str | None = None
    language: str | None = None
    seed: int | None = None


class AudioStream(EventStream):
    """Chunked audio bytes that cancel the request when the client leaves (as ``EventStream`` does)."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], handle, media_type: str):
        StreamingResponse.__init__(self, chunks, media_type=media_type,
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = chunks
        self._handle = handle


def _audio_settings(body: SpeechBody) -> dict[str, Any]:
    """Validate what does not depend on the model; each fault names its field."""
    if not body.input.strip():
        raise ApiError(400, "input must not be empty", param="input")
    if len(body.input) > MAX_INPUT_CHARS:
        raise ApiError(400, f"input is {len(body.input)} characters; at most {MAX_INPUT_CHARS} are allowed",
                       param="input")
    if body.stream_format not in (None, *STREAM_FORMATS):
        raise ApiError(400, f"stream_format must be one of {', '.join(STREAM_FORMATS)}", param="stream_format",
                       code="unsupported_parameter")
    try:
        fmt = audio.check_format(body.response_format or "mp3")  # OpenAI's default
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    try:
        speed = audio.check_speed(body.speed)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param="speed") from None
    return {"voice": body.voice, "instructions": body.instructions, "language": body.language, "format": fmt,
            "speed": speed, "stream": True}


def _param(message: str) -> str | None:
    for field in ("voice", "instructions", "language"):
        if field in message:
            return field
    return None


async def create_speech(request: Request) -> Response:
    state = request.app.state.ifb
    state.require_endpoint(ENDPOINT, PATH)  # 404 where absent, 400 naming the flag under it
    body = parse_body(await request.body(), SpeechBody)
    settings = _audio_settings(body)
    spec = RequestSpec(prompt=body.input, params=SamplingParams(max_tokens=1, seed=body.seed),
                       extras={**state.model_extras(body.model), "generate_audio": True, "speak_input": True,
                               "audio": settings})
    try:
        state.deployment.runtime.speech_request(spec)  # the model's own checks, answered before queueing
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=_param(str(exc))) from None
    handle = await state.submit(spec)
    outputs = handle.__aiter__()
    first = await outputs.__anext__()  # a failure before any audio still gets its status code
    if first.finished and first.finish_reason in ("error", "cancelled"):
        raise engine_error(first, "speech generation failed")
    if body.stream_format == "sse":
        return AudioStream(_events(first, outputs), handle, "text/event-stream")
    return AudioStream(_chunks(first, outputs), handle, audio.MEDIA_TYPES[settings["format"]])


async def _outputs(first, rest) -> AsyncGenerator[Any, None]:
    yield first
    async for out in rest:
        if out.finished and out.finish_reason == "error":
            # the status line is sent: the body ends short, which is what the client can see
            log.error("speech request failed mid-stream: %s", out.error)
            return
        yield out


async def _chunks(first, rest) -> AsyncGenerator[bytes, None]:
    async for out in _outputs(first, rest):
        if out.audio_chunk:
            yield out.audio_chunk


async def _events(first, rest) -> AsyncGenerator[bytes, None]:
    async for out in _outputs(first, rest):
        if out.audio_chunk:
            yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(out.audio_chunk).decode()})
        if out.finished:
            usage = {"input_tokens": out.num_prompt_tokens, "output_tokens": out.num_output_tokens,
                     "total_tokens": out.num_prompt_tokens + out.num_output_tokens}
            yield _sse({"type": "speech.audio.done", "usage": usage})


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def speech_routes() -> list[Route]:
    return [Route(PATH, create_speech, methods=["POST"])]
