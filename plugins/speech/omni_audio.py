"""The Qwen3-Omni Thinker's audio input: Whisper log-mel features and its audio encoder (``thinker.audio_tower.*``).

The encoder is the shared layer's Qwen3 audio encoder (``ifb_plugins.common.media.qwen3_audio``,
as transformers' ``Qwen3OmniMoeAudioEncoder``). The features are ``WhisperFeatureExtractor``'s
as Qwen3-Omni's processor calls it (``padding=True``: one clip is not padded to 30 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ifb_plugins.common.loading.processor import ProcessorFiles
from ifb_plugins.common.media.mel import log_mel_features
from ifb_plugins.common.media.qwen3_audio import AudioEncoder, AudioEncoderConfig
from ifb_plugins.speech.weights import adopt, load_prefixed


@attrs.frozen
class FeatureConfig:
    """The Whisper feature extractor's settings."""

    num_mels: int
    n_fft: int = 400
    hop_length: int = 160
    sampling_rate: int = 16000

    @classmethod
    def read(cls, path: Path, num_mel_bins: int) -> "FeatureConfig":
        """The checkpoint's settings, from either processor file (``ProcessorFiles``)."""
        files = ProcessorFiles.read(path)
        raw, where = files.feature_extractor, files.audio_source or str(path)
        if float(raw.get("dither", 0.0)) != 0.0:
            raise ValueError(f"{where}: dither {raw['dither']} is not supported (deterministic features only)")
        cfg = cls(int(raw.get("feature_size", num_mel_bins)), int(raw.get("n_fft", 400)),
                  int(raw.get("hop_length", 160)), int(raw.get("sampling_rate", 16000)))
        if cfg.num_mels != num_mel_bins:
            raise ValueError(f"{where}: feature_size {cfg.num_mels} differs from the audio encoder's "
                             f"num_mel_bins {num_mel_bins}")
        return cfg

    def features(self, samples: np.ndarray) -> np.ndarray:
        """Log-mel features ``[M, F]`` of mono samples at ``sampling_rate`` (``F = len // hop_length``)."""
        num_samples = max(int(samples.size), self.hop_length)  # a clip shorter than a hop still gives a frame
        return log_mel_features(samples, self.num_mels, num_samples=num_samples, n_fft=self.n_fft,
                                hop_length=self.hop_length, sampling_rate=self.sampling_rate)


def load_audio_encoder(path: Path, raw: dict[str, Any]) -> tuple[AudioEncoder, FeatureConfig]:
    """The Thinker's audio tower (``thinker.audio_tower.*``) and its feature extractor's settings."""
    cfg = AudioEncoderConfig.from_dict(raw["thinker_config"].get("audio_config") or {})
    encoder = adopt(lambda: AudioEncoder(cfg), load_prefixed(path, "thinker.audio_tower."), "audio encoder")
    return encoder, FeatureConfig.read(path, cfg.num_mel_bins)
