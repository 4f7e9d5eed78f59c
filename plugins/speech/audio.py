"""Audio containers: WAV and raw PCM (stdlib), MP3 (``lameenc``), FLAC and Ogg Opus (``soundfile``, libsndfile).

``encode`` writes a whole utterance; ``StreamEncoder`` takes samples as they
are decoded and returns the bytes that can be sent so far. Streamed WAV has
the "unknown length" header (sizes 0xFFFFFFFF) that players accept for
streams; a streamed FLAC keeps its first STREAMINFO (total samples 0:
unknown), as libsndfile only rewrites it when the file is closed.
"""

from __future__ import annotations

import io
import struct
import wave

import numpy as np

from ifb.params import InvalidRequest

#: OpenAI's ``speed`` range for /v1/audio/speech
MIN_SPEED, MAX_SPEED = 0.25, 4.0
FORMATS = ("mp3", "opus", "flac", "wav", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "flac": "audio/flac",
               "opus": "audio/ogg"}
#: chat's ``audio.format`` says pcm16 where /v1/audio/speech says pcm
_ALIASES = {"pcm16": "pcm"}
MP3_BIT_RATE_KBPS = 64
_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "opus": ("OGG", "OPUS")}


def check_format(fmt: object) -> str:
    """The canonical format name; InvalidRequest naming the supported ones otherwise."""
    name = _ALIASES.get(fmt, fmt) if isinstance(fmt, str) else fmt
    if name in FORMATS:
        return name
    raise InvalidRequest(f"unsupported audio format {fmt!r}; supported formats: {', '.join(FORMATS)}")


def check_speed(speed: object) -> float:
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidRequest(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}")
    return float(speed)


def to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> little-endian signed 16-bit PCM."""
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def wav_header(sample_rate: int, num_bytes: int | None) -> bytes:
    """A 44-byte mono 16-bit RIFF header; ``None``: a stream of unknown length."""
    data = 0xFFFFFFFF if num_bytes is None else num_bytes
    riff = 0xFFFFFFFF if num_bytes is None else 36 + num_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate,
                                                                           sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


def encode(samples: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """The whole utterance ``samples [S]`` (float32 in [-1, 1]) in container ``fmt``, mono."""
    fmt = check_format(fmt)
    if fmt == "pcm":
        return to_pcm16(samples)
    if fmt == "wav":
        buf = io.BytesIO()
        with wave.open(buf, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(sample_rate)
            out.writeframes(to_pcm16(samples))
        return buf.getvalue()
    if fmt in _SOUNDFILE:
        import soundfile

        buf = io.BytesIO()
        container, subtype = _SOUNDFILE[fmt]
        soundfile.write(buf, np.clip(samples, -1.0, 1.0), sample_rate, format=container, subtype=subtype)
        return buf.getvalue()
    encoder = StreamEncoder(fmt, sample_rate)
    return encoder.feed(samples) + encoder.finish()


class _Sink(io.RawIOBase):
    """A growing buffer for libsndfile; ``take`` returns what was appended since the last call."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0
        self.sent = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        self.buf[self.pos:self.pos + len(data)] = data
        self.pos += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        end = len(self.buf) if size < 0 else min(len(self.buf), self.pos + size)
        data, self.pos = bytes(self.buf[self.pos:end]), end
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.buf) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def take(self) -> bytes:
        data, self.sent = bytes(self.buf[self.sent:]), len(self.buf)
        return data


class StreamEncoder:
    """Encode samples as they arrive: ``feed`` and ``finish`` return the bytes ready to send."""

    def __init__(self, fmt: str, sample_rate: int):
        self.fmt = check_format(fmt)
        self.sample_rate = sample_rate
        self._started = False
        if self.fmt == "mp3":
            import lameenc

            self._mp3 = lameenc.Encoder()
            self._mp3.set_bit_rate(MP3_BIT_RATE_KBPS)
            self._mp3.set_in_sample_rate(sample_rate)
            self._mp3.set_channels(1)
            self._mp3.set_quality(2)
        elif self.fmt in _SOUNDFILE:
            import soundfile

            container, subtype = _SOUNDFILE[self.fmt]
            self._sink = _Sink()
            self._file = soundfile.SoundFile(self._sink, mode="w", samplerate=sample_rate, channels=1,
                                             format=container, subtype=subtype)

    def feed(self, samples: np.ndarray) -> bytes:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self.fmt in ("pcm", "wav"):
            head = b"" if self._started or self.fmt == "pcm" else wav_header(self.sample_rate, None)
            self._started = True
            return head + to_pcm16(samples)
        if self.fmt == "mp3":
            return bytes(self._mp3.encode(to_pcm16(samples)))
        self._file.write(np.clip(samples, -1.0, 1.0))
        return self._sink.take()

    def finish(self) -> bytes:
        if self.fmt == "wav" and not self._started:
            return wav_header(self.sample_rate, None)
        if self.fmt == "mp3":
            return bytes(self._mp3.flush())
        if self.fmt in _SOUNDFILE:
            self._file.close()
            return self._sink.take()
        return b""
