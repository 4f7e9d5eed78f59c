"""The audio front end in numpy: resampling and Whisper's log-mel features (``WhisperFeatureExtractor``).

The feature extractor pads the waveform with zeros to its chunk (30 s for
Qwen2-Audio), takes a centred, reflect-padded Hann STFT (its last frame
dropped), the power spectrum through Slaney mel filters, log10 clamped at 1e-10,
floored 8 below the maximum of the whole padded chunk and scaled by
``(x + 4) / 4``. Frames of pure padding are ``log10(1e-10)`` before the floor, so
only the frames a caller needs are computed and the rest enter the maximum as
that constant.
"""

from __future__ import annotations

import functools
import math

import numpy as np

LOG_FLOOR = -10.0  # log10 of the clamp: what a frame of pure zero padding gives


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    freq = np.asarray(freq, dtype=np.float64)
    log = min_log_mel + np.log(np.maximum(freq, min_log_hz) / min_log_hz) / logstep
    return np.where(freq >= min_log_hz, log, freq / f_sp)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), mel * f_sp)


@functools.lru_cache(maxsize=8)
def mel_filterbank(num_mels: int, n_fft: int, sampling_rate: int) -> np.ndarray:
    """Triangular filters ``[num_mels, n_fft // 2 + 1]`` (float64) on the Slaney scale, area-normalized."""
    fft_freqs = np.linspace(0, sampling_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(0.0, float(_hz_to_mel(sampling_rate / 2.0)), num_mels + 2))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (fft_freqs[None, :] - lower) / (center - lower)
    falling = (upper - fft_freqs[None, :]) / (upper - center)
    filters = np.maximum(np.minimum(rising, falling), 0.0)
    # Slaney normalization: every filter has the same area, so wide high-frequency bands are not louder.
    return filters * (2.0 / (upper - lower))


def log_mel_features(audio: np.ndarray, num_mels: int, *, num_samples: int, num_frames: int | None = None,
                     n_fft: int = 400, hop_length: int = 160, sampling_rate: int = 16000) -> np.ndarray:
    """The first ``num_frames`` frames ``[num_mels, num_frames]`` float32 of the features of ``audio`` padded
    with zeros to ``num_samples`` (all ``num_samples // hop_length`` frames by default)."""
    if audio.size > num_samples:
        raise ValueError(f"{audio.size} samples do not fit the feature extractor's {num_samples}")
    total = num_samples // hop_length
    num_frames = total if num_frames is None else min(num_frames, total)
    wave = np.zeros(num_samples, dtype=np.float32)
    wave[:audio.size] = audio
    padded = np.pad(wave, n_fft // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop_length][:num_frames]  # [F, n_fft]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann
    power = np.abs(np.fft.rfft(frames.astype(np.float64) * window, axis=-1)) ** 2  # [F, n_fft/2 + 1]
    log = np.log10(np.maximum(mel_filterbank(num_mels, n_fft, sampling_rate) @ power.T, 1e-10))  # [M, F]
    # the frames not computed are pure padding exactly when they lie past the signal and its window
    peak = log.max()
    if num_frames < total:
        peak = max(peak, LOG_FLOOR)
    return ((np.maximum(log, peak - 8.0) + 4.0) / 4.0).astype(np.float32)


def resample_linear(audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample mono ``audio [L]`` by linear interpolation between neighbouring samples."""
    if from_rate == to_rate or audio.size == 0:
        return audio
    num_out = max(1, round(audio.size * to_rate / from_rate))
    src = np.arange(num_out, dtype=np.float64) * (from_rate / to_rate)
    left = np.minimum(np.floor(src).astype(np.int64), audio.size - 1)
    right = np.minimum(left + 1, audio.size - 1)
    frac = (src - left).astype(np.float32)
    return audio[left] * (1.0 - frac) + audio[right] * frac
