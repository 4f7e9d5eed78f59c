"""Test helpers: media encoded as clients send it (PNG and WAV bytes, OpenAI content parts)."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np


def png_bytes(seed: int, width: int = 24, height: int = 20, mode: str = "RGB") -> bytes:
    """A random-noise image encoded as PNG."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes, mime: str = "image/png") -> dict:
    """An OpenAI ``image_url`` content part carrying ``data`` inline."""
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def wav_bytes(seed: int, seconds: float = 0.3, rate: int = 16000, sample_width: int = 2, channels: int = 1) -> bytes:
    """A random tone-plus-noise clip encoded as PCM WAV."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.5 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t) + 0.1 * rng.standard_normal(t.size)
    signal = np.clip(np.repeat(signal[:, None], channels, axis=1), -1, 1)
    if sample_width == 1:
        raw = ((signal + 1) * 127.5).astype(np.uint8).tobytes()
    else:
        raw = (signal * 32767).astype("<i2").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(1 if sample_width == 1 else 2)
        wav.setframerate(rate)
        wav.writeframes(raw)
    return buf.getvalue()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    """An OpenAI ``input_audio`` content part."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
