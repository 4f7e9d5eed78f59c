"""OpenAI-style content parts: parsing, fetching (inline or local only) and decoding.

Every problem a client can cause raises ``InvalidRequest`` with a message that
names the part, which the server turns into a 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.parse
import wave
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np
from PIL import Image, UnidentifiedImageError

from ifb.params import InvalidRequest

MAX_MEDIA_BYTES = 20 * 1024 * 1024
MAX_IMAGE_SIDE = 4096
MAX_AUDIO_SECONDS = 30.0
MAX_MEDIA_ITEMS = 16
PART_TYPES = ("text", "image_url", "input_audio")


@attrs.frozen
class MediaItem:
    """One decoded image (``data``: a Pillow image as the file holds it) or audio clip (``data [L]``: mono
    float32 samples at the model's sampling rate)."""

    kind: Literal["image", "audio"]
    digest: bytes  # of the raw bytes as sent: two different files never share KV
    data: Any = attrs.field(eq=False, repr=False)


def _b64decode(text: str, where: str) -> bytes:
    # Checked on the encoded length, before decoding allocates anything.
    if len(text) * 3 // 4 > MAX_MEDIA_BYTES:
        raise InvalidRequest(f"{where} is larger than {MAX_MEDIA_BYTES // (1024 * 1024)} MB")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where} is not valid base64") from None


def _read_local(path: Path, where: str, allowed_dir: Path | None, allow_hint: str | None = None) -> bytes:
    # A client naming server files is only allowed inside a directory the operator chose.
    if allowed_dir is None:
        hint = f" (or {allow_hint})" if allow_hint else ""
        raise InvalidRequest(f"{where}: local files are not allowed; send the media inline as a data: URL{hint}")
    path = path.resolve()
    if not path.is_relative_to(allowed_dir.resolve()):
        raise InvalidRequest(f"{where}: local files must be under the allowed media directory")
    if not path.is_file():
        raise InvalidRequest(f"{where}: no such file on the server: {path}")
    if path.stat().st_size > MAX_MEDIA_BYTES:
        raise InvalidRequest(f"{where} is larger than {MAX_MEDIA_BYTES // (1024 * 1024)} MB")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"{where}: cannot read {path}: {exc.strerror or exc}") from None


def fetch_image_bytes(url: str, where: str, allowed_dir: Path | None = None, allow_hint: str | None = None) -> bytes:
    """The bytes an ``image_url`` names: a base64 ``data:`` URL, a ``file://`` URL or a local path."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where} needs a non-empty url")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequest(f"{where}: a data URL must be base64 (data:image/png;base64,...)")
        return _b64decode(payload, where)
    if scheme in ("http", "https"):
        raise InvalidRequest(f"{where}: remote URLs cannot be fetched (the server works offline); "
                             "send the image inline as a data:image/...;base64 URL")
    if scheme == "file":
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidRequest(f"{where}: file URLs must name a local file (file:///path)")
        return _read_local(Path(urllib.parse.unquote(parsed.path)), where, allowed_dir, allow_hint)
    if len(scheme) > 1:  # "c:" would be a Windows drive, anything longer a scheme we do not fetch
        raise InvalidRequest(f"{where}: unsupported URL scheme {scheme!r} (data, file or a local path)")
    return _read_local(Path(url).expanduser(), where, allowed_dir, allow_hint)


def decode_image(raw: bytes, where: str) -> Image.Image:
    """Decode with Pillow (every pixel read, so a truncated file fails here); the processor does the rest."""
    try:
        image = Image.open(io.BytesIO(raw))
    except UnidentifiedImageError:
        raise InvalidRequest(f"{where} is not an image Pillow can read") from None
    except Exception as exc:  # noqa: BLE001 - a malformed header is the client's fault
        raise InvalidRequest(f"{where} could not be decoded: {exc}") from None
    width, height = image.size
    # The header is read lazily: refuse before decoding pixels (decompression bombs).
    if width > MAX_IMAGE_SIDE or height > MAX_IMAGE_SIDE:
        raise InvalidRequest(f"{where} is {width}x{height}; images may be at most {MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE}")
    if width < 1 or height < 1:
        raise InvalidRequest(f"{where} is empty ({width}x{height})")
    try:
        image.load()
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data
        raise InvalidRequest(f"{where} could not be decoded: {exc}") from None
    return image


def decode_wav(raw: bytes, where: str, sampling_rate: int) -> np.ndarray:
    """Decode PCM WAV with the stdlib, mix down to mono, resample to ``sampling_rate``: ``[L]`` in [-1, 1]."""
    try:
        with wave.open(io.BytesIO(raw), "rb") as wav:
            channels, width, rate, num_frames = (wav.getnchannels(), wav.getsampwidth(), wav.getframerate(),
                                                 wav.getnframes())
            if rate <= 0:
                raise InvalidRequest(f"{where} has a sample rate of {rate}")
            if num_frames / rate > MAX_AUDIO_SECONDS:
                raise InvalidRequest(f"{where} is {num_frames / rate:.1f} s long; audio may be at most "
                                     f"{MAX_AUDIO_SECONDS:g} s")
            frames = wav.readframes(num_frames)
    except (wave.Error, EOFError) as exc:
        raise InvalidRequest(f"{where} is not a PCM WAV file ({exc})") from None
    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(frames[: len(frames) // 3 * 3], dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        samples = (np.where(value >= 1 << 23, value - (1 << 24), value) / float(1 << 23)).astype(np.float32)
    elif width == 4:
        samples = (np.frombuffer(frames, dtype="<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    else:
        raise InvalidRequest(f"{where} has {8 * width}-bit samples (8, 16, 24 or 32-bit PCM is supported)")
    samples = samples[: len(samples) // channels * channels].reshape(-1, channels).mean(axis=1)
    if samples.size == 0:
        raise InvalidRequest(f"{where} holds no audio")
    from ifb_plugins.common.media.mel import resample_linear

    return resample_linear(np.ascontiguousarray(samples, dtype=np.float32), rate, sampling_rate)


@attrs.frozen
class ParsedMessages:
    """Messages whose media parts became the chat templates' ``{"type": "image"}`` / ``{"type": "audio"}``
    parts (text parts stay ``{"type": "text", "text": ...}``), and the decoded media, in order."""

    messages: tuple[dict, ...]
    media: tuple[MediaItem, ...]


def parse_messages(messages: tuple[dict, ...], *, modalities: frozenset[str] | set[str], sampling_rate: int,
                   allowed_dir: Path | None = None, allow_hint: str | None = None) -> ParsedMessages:
    """Decode the media parts of OpenAI-style messages; a part of a modality the model lacks is refused.

    ``allowed_dir``: the directory local files may be read from (None: none may); ``allow_hint``: how the
    operator allows them, for the refusal's message (None where the deployment cannot)."""
    out, media = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequest(f"messages[{i}] needs a role and content")
        content = message.get("content")
        if content is None or isinstance(content, str):
            out.append(message)
            continue
        if not isinstance(content, (list, tuple)):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of content parts")
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest(f"{where} of type text needs a text string")
                parts.append({"type": "text", "text": text})
                continue
            if kind not in PART_TYPES:
                raise InvalidRequest(f"{where}: unknown content part type {kind!r} ({', '.join(PART_TYPES)})")
            modality = "image" if kind == "image_url" else "audio"
            if modality not in modalities:
                raise InvalidRequest(f"{where}: this model takes no {modality} input")
            if len(media) >= MAX_MEDIA_ITEMS:
                raise InvalidRequest(f"at most {MAX_MEDIA_ITEMS} images and audio clips are allowed per request")
            media.append(_decode_part(part, kind, where, sampling_rate, allowed_dir, allow_hint))
            parts.append({"type": modality})
        out.append({**message, "content": parts})
    return ParsedMessages(tuple(out), tuple(media))


def _decode_part(part: dict[str, Any], kind: str, where: str, sampling_rate: int,
                 allowed_dir: Path | None = None, allow_hint: str | None = None) -> MediaItem:
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        raw = fetch_image_bytes(url, f"{where}.image_url", allowed_dir, allow_hint)
        image = decode_image(raw, f"{where}.image_url")
        return MediaItem("image", hashlib.blake2b(raw, digest_size=16).digest(), image)
    audio = part.get("input_audio")
    if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
        raise InvalidRequest(f"{where} of type input_audio needs input_audio.data (base64 WAV)")
    fmt = str(audio.get("format", "wav")).lower()
    if fmt != "wav":
        raise InvalidRequest(f"{where}: audio format {fmt!r} is not supported (wav)")
    raw = _b64decode(audio["data"], f"{where}.input_audio.data")
    samples = decode_wav(raw, f"{where}.input_audio.data", sampling_rate)
    return MediaItem("audio", hashlib.blake2b(raw, digest_size=16).digest(), samples)

