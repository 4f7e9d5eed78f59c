"""``POST /v1/audio/speech`` (OpenAI's text-to-speech endpoint) for speech deployments.

Body: ``{"model", "input", "voice", "response_format": "wav" | "pcm" | "mp3", "speed"}``.
The answer is the audio itself (``audio/wav``, ``audio/pcm``: raw 16-bit
little-endian mono at 24 kHz, or ``audio/mpeg``). Under in-flight batching
the route answers 400 naming the flag: speech runs on the blocking path only.
"""

from __future__ import annotations

from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb.server.errors import ApiError
from ifb.server.openai_routes import until_disconnect
from ifb.server.schemas import parse_body
from ifb_plugins.speech import SPEAK_PROMPT, audio

ENDPOINT = "audio.speech"
PATH = "/v1/audio/speech"
#: OpenAI's limit on ``input``
MAX_INPUT_CHARS = 4096


@attrs.frozen
class SpeechRequest:
    """OpenAI's ``POST /v1/audio/speech`` body."""

    input: str
    model: str | None = None
    voice: str | None = None
    response_format: str | None = None
    speed: float | None = None
    instructions: str | None = None
    stream_format: str | None = None


def _settings(body: SpeechRequest, voices: tuple[str, ...]) -> dict[str, Any]:
    """Validate the body against the deployment; each fault names its field."""
    if not body.input.strip():
        raise ApiError(400, "input must not be empty", param="input")
    if len(body.input) > MAX_INPUT_CHARS:
        raise ApiError(400, f"input is {len(body.input)} characters; at most {MAX_INPUT_CHARS} are allowed",
                       param="input")
    if body.instructions:
        raise ApiError(400, "instructions are not supported by this model", param="instructions",
                       code="unsupported_parameter")
    if body.stream_format not in (None, "audio"):
        raise ApiError(400, "only stream_format 'audio' is supported (the whole file in one response)",
                       param="stream_format", code="unsupported_parameter")
    if body.voice is not None and body.voice not in voices:
        raise ApiError(400, f"unknown voice {body.voice!r}; this model's voices: {', '.join(voices)}",
                       param="voice")
    try:
        fmt = audio.check_format(body.response_format or audio.default_speech_format())
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    speed = 1.0 if body.speed is None else body.speed
    if not audio.MIN_SPEED <= speed <= audio.MAX_SPEED:
        raise ApiError(400, f"speed must be between {audio.MIN_SPEED} and {audio.MAX_SPEED}", param="speed")
    return {"voice": body.voice, "format": fmt, "speed": speed}


async def create_speech(request: Request) -> Response:
    state = request.app.state.ifb
    state.require_endpoint(ENDPOINT, PATH)  # 404 where absent, 400 naming the flag under it
    body = parse_body(await request.body(), SpeechRequest)
    runtime = state.deployment.runtime
    settings = _settings(body, tuple(runtime.speech_config.talker.voices))
    extras = {**state.model_extras(body.model), "generate_audio": True, SPEAK_PROMPT: True, "audio": settings}
    spec = RequestSpec(prompt=body.input, params=SamplingParams(max_tokens=1), extras=extras)
    timer = state.metrics.timer()
    handle = await state.submit(spec)
    final = None

    async def wait() -> None:
        nonlocal final
        async for out in handle:
            timer.observe(out)
            if out.finished:
                final = out

    try:
        present, _ = await until_disconnect(request, handle, wait)
    finally:
        timer.finish()
    if not present:
        return Response(status_code=499)  # the client left; its request was cancelled
    if final is None or final.finish_reason == "error" or "speech" not in final.extras:
        status = int((final.extras if final is not None else {}).get("status", 500))
        message = final.error if final is not None and final.error else "speech generation failed"
        raise ApiError(status, message, code="engine_full" if status == 429 else None)
    speech = final.extras["speech"]
    return Response(speech["data"], media_type=audio.MEDIA_TYPES[speech["format"]])


def speech_routes() -> list[Route]:
    return [Route(PATH, create_speech, methods=["POST"])]
