"""Audio containers and request settings: WAV (stdlib ``wave``), raw PCM, and MP3 when an encoder is installed.

MP3 uses the ``lameenc`` package (LAME bindings) when it is importable;
without it a request for mp3 gets a 400 that names the formats served.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import time
import uuid
import wave
from typing import Any, Sequence

import attrs
import numpy as np
import torch

from ifb.params import InvalidRequest

#: OpenAI's ``speed`` range for /v1/audio/speech
MIN_SPEED, MAX_SPEED = 0.25, 4.0

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg"}
#: chat's ``audio.format`` says pcm16 where /v1/audio/speech says pcm
_ALIASES = {"pcm16": "pcm"}
MP3_BIT_RATE_KBPS = 64
#: how long the base64 audio on a chat reply is said to stay valid (OpenAI's ``expires_at``)
AUDIO_TTL_S = 3600


def mp3_available() -> bool:
    return importlib.util.find_spec("lameenc") is not None


def supported_formats() -> tuple[str, ...]:
    return ("wav", "pcm", "mp3") if mp3_available() else ("wav", "pcm")


def default_speech_format() -> str:
    """/v1/audio/speech's default: OpenAI's (mp3) when an encoder is installed, else wav."""
    return "mp3" if mp3_available() else "wav"


def check_format(fmt: str) -> str:
    """The canonical format name; InvalidRequest naming the supported ones otherwise."""
    name = _ALIASES.get(fmt, fmt) if isinstance(fmt, str) else fmt
    supported = supported_formats()
    if name in supported:
        return name
    served = ", ".join(supported)
    if name == "mp3":
        raise InvalidRequest(f"response format 'mp3' needs an MP3 encoder, which is not installed "
                             f"(pip install lameenc); supported formats: {served}")
    raise InvalidRequest(f"unsupported audio format {fmt!r}; supported formats: {served}")


@attrs.frozen
class AudioSettings:
    """What a request asks of the speech it gets: voice, container format and speed."""

    voice: str
    format: str = "wav"
    speed: float = 1.0

    @classmethod
    def from_extras(cls, extras: dict[str, Any], voices: Sequence[str], default_format: str = "wav") -> AudioSettings:
        """Read ``extras["audio"]`` (``voice``, ``format``, ``speed``); raise InvalidRequest on bad values."""
        raw = extras.get("audio") or {}
        if not isinstance(raw, dict):
            raise InvalidRequest("audio must be an object with voice, format and speed")
        voice = raw.get("voice")
        if voice is None:
            voice = voices[0]
        elif voice not in voices:
            raise InvalidRequest(f"unknown voice {voice!r}; this model's voices: {', '.join(voices)}")
        fmt = check_format(raw.get("format") or default_format)
        speed = raw.get("speed", 1.0)
        if speed is None:
            speed = 1.0
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
            raise InvalidRequest(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}")
        return cls(voice=voice, format=fmt, speed=float(speed))


def change_speed(codes: Sequence[int], speed: float) -> list[int]:
    """Resample the code sequence (nearest code) to ``round(n / speed)`` codes.

    Working on codes keeps each code's sound (and so the pitch) while the
    duration scales by 1 / speed.
    """
    n = len(codes)
    if n == 0 or speed == 1.0:
        return list(codes)
    num_out = max(1, round(n / speed))
    return [codes[min(n - 1, i * n // num_out)] for i in range(num_out)]


def to_pcm16(waveform: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] -> little-endian signed 16-bit PCM."""
    samples = waveform.detach().float().clamp(-1.0, 1.0).cpu().numpy()
    return np.round(samples * 32767.0).astype("<i2").tobytes()


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm)
    return buf.getvalue()


def mp3_bytes(pcm: bytes, sample_rate: int) -> bytes:
    import lameenc

    encoder = lameenc.Encoder()
    encoder.set_bit_rate(MP3_BIT_RATE_KBPS)
    encoder.set_in_sample_rate(sample_rate)
    encoder.set_channels(1)
    encoder.set_quality(2)
    return bytes(encoder.encode(pcm) + encoder.flush())


def encode(waveform: torch.Tensor, fmt: str, sample_rate: int) -> bytes:
    """The waveform in container ``fmt`` (wav, pcm or mp3), mono 16-bit at ``sample_rate``."""
    pcm = to_pcm16(waveform)
    fmt = check_format(fmt)
    if fmt == "pcm":
        return pcm
    if fmt == "mp3":
        return mp3_bytes(pcm, sample_rate)
    return wav_bytes(pcm, sample_rate)


def chat_audio(data: bytes, transcript: str) -> dict[str, Any]:
    """OpenAI's ``choices[0].message.audio``: ``{id, data (base64), expires_at, transcript}``."""
    return {"id": f"audio_{uuid.uuid4().hex}", "data": base64.b64encode(data).decode("ascii"),
            "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": transcript}
