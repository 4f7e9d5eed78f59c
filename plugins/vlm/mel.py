"""The audio front end in torch: resampling and Whisper's log-mel spectrogram."""

from __future__ import annotations

import functools
import math

import torch


def _hz_to_mel(freq: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    linear = freq / f_sp
    log = min_log_mel + torch.log(torch.clamp(freq, min=min_log_hz) / min_log_hz) / logstep
    return torch.where(freq >= min_log_hz, log, linear)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    linear = mel * f_sp
    log = min_log_hz * torch.exp(logstep * (mel - min_log_mel))
    return torch.where(mel >= min_log_mel, log, linear)


@functools.lru_cache(maxsize=8)
def mel_filterbank(num_mels: int, n_fft: int, sampling_rate: int) -> torch.Tensor:
    """Triangular filters ``[num_mels, n_fft // 2 + 1]`` on the Slaney scale, area-normalized (Slaney)."""
    fft_freqs = torch.linspace(0, sampling_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    mel_edges = torch.linspace(0.0, float(_hz_to_mel(torch.tensor(sampling_rate / 2.0, dtype=torch.float64))),
                               num_mels + 2, dtype=torch.float64)
    edges = _mel_to_hz(mel_edges)  # [num_mels + 2] Hz
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (fft_freqs[None, :] - lower) / (center - lower)
    falling = (upper - fft_freqs[None, :]) / (upper - center)
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    # Slaney normalization: every filter has the same area, so wide high-frequency bands are not louder.
    return (filters * (2.0 / (upper - lower))).float()


def log_mel_spectrogram(audio: torch.Tensor, num_mels: int, n_fft: int = 400, hop_length: int = 160,
                        sampling_rate: int = 16000) -> torch.Tensor:
    """Whisper's features ``[num_mels, len(audio) // hop_length]`` of mono float audio ``[L]``.

    Power spectrum of a centered, reflect-padded Hann STFT (last frame dropped),
    mel-filtered, log10, floored 8 below the maximum, then scaled to about [-1, 1].
    """
    audio = audio.float()
    if audio.numel() < n_fft:  # reflect padding needs more than half a window of signal
        audio = torch.nn.functional.pad(audio, (0, n_fft - audio.numel()))
    window = torch.hann_window(n_fft, device=audio.device)
    spec = torch.stft(audio, n_fft, hop_length, window=window, center=True, pad_mode="reflect",
                      return_complex=True)  # [n_fft/2 + 1, frames + 1]
    power = spec[:, :-1].abs() ** 2
    mel = mel_filterbank(num_mels, n_fft, sampling_rate).to(audio.device) @ power
    log = torch.clamp(mel, min=1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


def resample_linear(audio: torch.Tensor, from_rate: int, to_rate: int) -> torch.Tensor:
    """Resample mono ``audio [L]`` by linear interpolation between neighbouring samples."""
    if from_rate == to_rate or audio.numel() == 0:
        return audio
    num_out = max(1, round(audio.numel() * to_rate / from_rate))
    src = torch.arange(num_out, dtype=torch.float64) * (from_rate / to_rate)
    left = src.floor().long().clamp(max=audio.numel() - 1)
    right = (left + 1).clamp(max=audio.numel() - 1)
    frac = (src - left.double()).float()
    return audio[left] * (1.0 - frac) + audio[right] * frac
