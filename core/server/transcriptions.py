"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: audio to text, OpenAI's shapes.

The upload (multipart ``file``: WAV, MP3, FLAC or Ogg, at most
``MAX_AUDIO_BYTES``) is decoded here, mixed to mono and handed to the model as
a chat request: a user message holding the clip (as PCM WAV) and the
instruction (transcribe, or translate into English), the request's
``prompt`` as the system message. It is then served as any media request
(in-flight batching included). ``response_format``: ``json`` (default),
``text``, ``verbose_json`` (one segment: no timestamps are predicted),
``srt``, ``vtt``; ``stream: true`` answers with ``transcript.text.delta`` /
``transcript.text.done`` events. A deployment declares the endpoint
(``audio.transcriptions``); its model must hear audio.

The request also carries ``RequestSpec.transcription`` (``language``, ``prompt``,
whether to translate), for a model with its own transcription prompt, and the
output is read through the runtime's optional ``read_transcript``: a header
the model writes before the text (the language it heard) is not part of it.
"""

from __future__ import annotations

import base64
import io
import wave
from typing import Callable

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ifb.outputs import RequestOutput
from ifb.params import RequestSpec, SamplingParams
from ifb.server.errors import ApiError
from ifb.server.render import Collected, Sequence
from ifb.transcription import Transcript, Transcription

#: the largest upload taken (OpenAI's limit)
MAX_AUDIO_BYTES = 25 * 1024 * 1024
#: the longest transcript generated (Whisper's decoder limit)
MAX_TRANSCRIPT_TOKENS = 448
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "stream",
           "timestamp_granularities[]", "include[]", "chunking_strategy"}


def decode_audio(raw: bytes) -> tuple[np.ndarray, int]:
    """Mono float samples and their rate from a WAV, MP3, FLAC or Ogg file (400 for anything else)."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - libsndfile's reason is the client's answer
        raise ApiError(400, f"the file is not audio this server decodes (WAV, MP3, FLAC or Ogg): {exc}",
                       param="file") from None
    if samples.size == 0:
        raise ApiError(400, "the file holds no audio", param="file")
    return samples.mean(axis=1), int(rate)


def wav_pcm32(samples: np.ndarray, rate: int) -> bytes:
    """32-bit PCM WAV: what every audio plugin reads, with no precision lost to 16 bits."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(4)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1.0, 1.0 - 2 ** -31) * 2 ** 31).astype("<i4").tobytes())
    return buffer.getvalue()


def instruction(language: str | None, translate: bool) -> str:
    if translate:
        return "Translate the audio into English text."
    return f"Transcribe the audio into text. The audio is in {language}." if language else \
        "Transcribe the audio into text."


def _bool(value: str | None, name: str) -> bool:
    if value is None:
        return False
    if value.lower() not in ("true", "false"):
        raise ApiError(400, f"{name} must be true or false", param=name)
    return value.lower() == "true"


def _timestamp(seconds: float, separator: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"


def render(text: str, fmt: str, duration: float, language: str | None, usage: dict) -> Response:
    text = text.strip()
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "srt":
        return PlainTextResponse(f"1\n{_timestamp(0, ',')} --> {_timestamp(duration, ',')}\n{text}\n")
    if fmt == "vtt":
        return PlainTextResponse(f"WEBVTT\n\n{_timestamp(0, '.')} --> {_timestamp(duration, '.')}\n{text}\n",
                                 media_type="text/vtt")
    if fmt == "verbose_json":
        return JSONResponse({"task": "transcribe", "language": language or "unknown", "duration": duration,
                             "text": text, "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": duration,
                                                         "text": text, "tokens": [], "temperature": 0.0,
                                                         "avg_logprob": 0.0, "compression_ratio": 0.0,
                                                         "no_speech_prob": 0.0}]})
    return JSONResponse({"text": text, "usage": {"type": "tokens", "input_tokens": usage["prompt_tokens"],
                                                 "output_tokens": usage["completion_tokens"],
                                                 "total_tokens": usage["total_tokens"]}})


#: reads a transcription's output text (``Runtime.read_transcript``; the text itself without one)
Reader = Callable[[str, bool], Transcript]


def plain_transcript(text: str, is_final: bool) -> Transcript:
    return Transcript(text)


class TranscriptRenderer:
    """The stream: ``transcript.text.delta`` as the transcript grows, ``transcript.text.done`` with all of it."""

    done_marker = None
    include_usage = False

    def __init__(self, reader: Reader = plain_transcript):
        self.reader = reader
        self.sent = ""

    def opening(self) -> list:
        return []

    def _grow(self, transcript: str) -> list:
        # a reader only ever extends what it showed (a header is held back until it is read)
        if not transcript.startswith(self.sent) or len(transcript) == len(self.sent):
            return []
        delta, self.sent = transcript[len(self.sent):], transcript
        return [{"type": "transcript.text.delta", "delta": delta}]

    def delta(self, out: RequestOutput, seq: Sequence) -> list:
        return self._grow(self.reader("".join(seq.texts), False).text) if not out.finished else []

    def closing(self, collected: Collected) -> list:
        text = self.reader("".join(collected.seqs[0].texts), True).text
        usage = collected.usage()
        return [*self._grow(text), {
            "type": "transcript.text.done", "text": text.strip(),
            "usage": {"type": "tokens", "input_tokens": usage["prompt_tokens"],
                      "output_tokens": usage["completion_tokens"], "total_tokens": usage["total_tokens"]}}]

    def error_event(self, error: ApiError) -> dict:
        return error.body()


class _Whole(TranscriptRenderer):
    """The whole text in the asked ``response_format`` (not streamed)."""

    def __init__(self, reader: Reader, fmt: str, duration: float, language: str | None):
        super().__init__(reader)
        self.fmt, self.duration, self.language = fmt, duration, language

    def full(self, collected: Collected) -> Response:
        transcript = self.reader("".join(collected.seqs[0].texts), True)
        return render(transcript.text, self.fmt, self.duration, transcript.language or self.language,
                      collected.usage())


async def _handle(request: Request, translate: bool) -> Response:
    from ifb.server.openai_routes import app_state, generate

    state = app_state(request)
    path = "/v1/audio/translations" if translate else "/v1/audio/transcriptions"
    state.require_endpoint("audio.transcriptions", path)
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "multipart/form-data":
        raise ApiError(415, "send the audio as multipart/form-data with a file field", code="unsupported_media_type")
    try:
        form = await request.form(max_files=1, max_fields=16, max_part_size=MAX_AUDIO_BYTES)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed multipart body is the client's
        raise ApiError(400, f"the multipart body could not be read: {exc}") from None
    unknown = sorted(set(form.keys()) - _FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "the file field (the audio) is required", param="file")
    raw = await upload.read(MAX_AUDIO_BYTES + 1)
    if len(raw) > MAX_AUDIO_BYTES:
        raise ApiError(413, f"the audio file is larger than {MAX_AUDIO_BYTES} bytes", param="file")
    fmt = str(form.get("response_format") or "json")
    if fmt not in FORMATS:
        raise ApiError(400, f"unknown response_format {fmt!r} ({', '.join(FORMATS)})", param="response_format")
    if "word" in form.getlist("timestamp_granularities[]"):
        raise ApiError(400, "word timestamps are not supported", param="timestamp_granularities[]")
    stream = _bool(form.get("stream"), "stream")  # type: ignore[arg-type]
    try:
        temperature = float(form.get("temperature") or 0.0)  # type: ignore[arg-type]
    except ValueError:
        raise ApiError(400, "temperature must be a number", param="temperature") from None
    language = form.get("language") or None
    prompt = form.get("prompt") or None
    model = form.get("model") or None
    extras = state.model_extras(model if isinstance(model, str) else None)
    samples, rate = await run_in_threadpool(decode_audio, raw)
    clip = base64.b64encode(wav_pcm32(samples, rate)).decode()
    messages = [{"role": "system", "content": prompt}] if isinstance(prompt, str) else []
    messages.append({"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
        {"type": "text", "text": instruction(language if isinstance(language, str) else None, translate)}]})
    task = Transcription(language=language if isinstance(language, str) else None,
                         prompt=prompt if isinstance(prompt, str) else None, translate=translate)
    spec = RequestSpec(messages=tuple(messages), stream=stream,
                       params=SamplingParams(temperature=temperature, max_tokens=MAX_TRANSCRIPT_TOKENS),
                       extras=extras, transcription=task)
    reader: Reader = getattr(state.runtime, "read_transcript", None) or plain_transcript
    renderer = TranscriptRenderer(reader) if stream else _Whole(reader, fmt, len(samples) / rate, task.language)
    return await generate(request, state, spec, renderer)


async def transcriptions(request: Request) -> Response:
    return await _handle(request, translate=False)


async def translations(request: Request) -> Response:
    return await _handle(request, translate=True)


def transcription_routes() -> list[Route]:
    return [Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
            Route("/v1/audio/translations", translations, methods=["POST"])]
