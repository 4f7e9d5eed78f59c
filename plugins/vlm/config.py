"""The shapes of a LLaVA-style multimodal checkpoint, read from its ``config.json``.

A checkpoint carries ``text_config`` (a Llama-family decoder, built by the text
plugin), ``vision_config`` (a SigLIP/ViT-style encoder) and optionally
``audio_config`` (a Whisper-style encoder), plus the ids of the ``<image>`` and
``<audio>`` placeholder tokens. ``preprocessor_config.json``, when present,
overrides the image normalization and the audio front end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import attrs

from ifb_plugins.common.config import TextModelConfig


def _required(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{where} is missing {key!r}")
    return cfg[key]


@attrs.frozen
class VisionConfig:
    """A ViT/SigLIP-style encoder: patch conv, learned positions, pre-norm layers, final norm."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> VisionConfig:
        where = "vision_config"
        return cls(
            hidden_size=int(_required(cfg, "hidden_size", where)),
            intermediate_size=int(_required(cfg, "intermediate_size", where)),
            num_layers=int(_required(cfg, "num_hidden_layers", where)),
            num_heads=int(_required(cfg, "num_attention_heads", where)),
            image_size=int(_required(cfg, "image_size", where)),
            patch_size=int(_required(cfg, "patch_size", where)),
            num_channels=int(cfg.get("num_channels", 3)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-6)),
            hidden_act=str(cfg.get("hidden_act", "gelu_pytorch_tanh")),
        )


@attrs.frozen
class AudioConfig:
    """A Whisper-style encoder: two conv1d (the second halves the frame rate), positions, layers."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> AudioConfig:
        where = "audio_config"
        return cls(
            hidden_size=int(_required(cfg, "d_model", where)),
            intermediate_size=int(_required(cfg, "encoder_ffn_dim", where)),
            num_layers=int(_required(cfg, "encoder_layers", where)),
            num_heads=int(_required(cfg, "encoder_attention_heads", where)),
            num_mel_bins=int(cfg.get("num_mel_bins", 80)),
            max_source_positions=int(cfg.get("max_source_positions", 1500)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
            hidden_act=str(cfg.get("activation_function", "gelu")),
        )


@attrs.frozen
class Preprocess:
    """Image normalization and the log-mel front end (Whisper's defaults)."""

    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Preprocess:
        default = cls()
        return cls(
            image_mean=tuple(float(x) for x in cfg.get("image_mean", default.image_mean)),
            image_std=tuple(float(x) for x in cfg.get("image_std", default.image_std)),
            sampling_rate=int(cfg.get("sampling_rate", default.sampling_rate)),
            n_fft=int(cfg.get("n_fft", default.n_fft)),
            hop_length=int(cfg.get("hop_length", default.hop_length)),
        )


@attrs.frozen
class VlmConfig:
    text: TextModelConfig
    vision: VisionConfig | None
    audio: AudioConfig | None
    image_token_id: int | None
    audio_token_id: int | None
    projector_hidden_act: str = "gelu"
    preprocess: Preprocess = Preprocess()

    @classmethod
    def from_dir(cls, path: str | Path) -> VlmConfig:
        """Read ``config.json`` (and ``preprocessor_config.json`` if there is one) from a checkpoint."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path} is not a multimodal checkpoint: config.json is missing")
        cfg = json.loads(config_file.read_text())
        if "text_config" not in cfg:
            raise ValueError(f"{config_file} has no text_config: not a multimodal (LLaVA-style) checkpoint")
        if "vision_config" not in cfg and "audio_config" not in cfg:
            raise ValueError(f"{config_file} has neither vision_config nor audio_config")
        vision = VisionConfig.from_hf(cfg["vision_config"]) if cfg.get("vision_config") else None
        audio = AudioConfig.from_hf(cfg["audio_config"]) if cfg.get("audio_config") else None
        image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
        audio_token = cfg.get("audio_token_id", cfg.get("audio_token_index"))
        if vision is not None and image_token is None:
            raise ValueError(f"{config_file} has a vision_config but no image_token_id")
        if audio is not None and audio_token is None:
            raise ValueError(f"{config_file} has an audio_config but no audio_token_id")
        pre_file = path / "preprocessor_config.json"
        pre = Preprocess.from_hf(json.loads(pre_file.read_text())) if pre_file.exists() else Preprocess()
        return cls(
            text=TextModelConfig.from_hf_config(cfg["text_config"]),
            vision=vision, audio=audio,
            image_token_id=int(image_token) if vision is not None else None,
            audio_token_id=int(audio_token) if audio is not None else None,
            projector_hidden_act=str(cfg.get("projector_hidden_act", "gelu")),
            preprocess=pre,
        )
