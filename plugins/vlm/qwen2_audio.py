"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``): a Whisper-style encoder, pooling, a projector, Qwen2.

What the processor does to one clip: Whisper's log-mel features of the clip
padded to the feature extractor's chunk (``mel.log_mel_features``), L real
frames (``ceil(samples / hop)``), and ``<|AUDIO|>`` expanded into
``(((L - 1) // 2 + 1) - 2) // 2 + 1`` audio tokens.

What the model does: two GELU convolutions (the second halves the frame rate),
learned positions, pre-norm layers whose attention masks the positions past the
clip (so the outputs there are never needed: the encoder here runs on the clip's
own positions only), average pooling by two, ``layer_norm``, and a linear
projector into the decoder's width.

Shape letters: M mel bins, F mel frames, N encoder positions, D encoder width, H decoder width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ifb.params import InvalidRequest
from ifb_plugins.vlm.checkpoint import (
    ProcessorFiles, load_module, load_state, load_text_model, load_tokenizer, read_json, special_token_id,
    split_state,
)
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.media.mel import log_mel_features
from ifb_plugins.common.media.vision import activation


@attrs.frozen
class AudioConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_mel_bins: int = 128
    max_source_positions: int = 1500
    hidden_act: str = "gelu"

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> AudioConfig:
        return cls(hidden_size=int(cfg.get("d_model", 1280)), intermediate_size=int(cfg.get("encoder_ffn_dim", 5120)),
                   num_layers=int(cfg.get("encoder_layers", 32)), num_heads=int(cfg.get("encoder_attention_heads", 20)),
                   num_mel_bins=int(cfg.get("num_mel_bins", 128)),
                   max_source_positions=int(cfg.get("max_source_positions", 1500)),
                   hidden_act=str(cfg.get("activation_function", "gelu")))


@attrs.frozen
class FeatureExtraction:
    """``WhisperFeatureExtractor`` settings."""

    num_mel_bins: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> FeatureExtraction:
        kind = cfg.get("feature_extractor_type", "WhisperFeatureExtractor")
        if kind != "WhisperFeatureExtractor":
            raise ValueError(f"feature extractor {kind!r} is not supported (WhisperFeatureExtractor)")
        if cfg.get("dither", 0.0) or cfg.get("do_normalize", False):
            raise ValueError("dithered or normalized Whisper features are not supported")
        base = cls()
        return cls(num_mel_bins=int(cfg.get("feature_size", base.num_mel_bins)),
                   sampling_rate=int(cfg.get("sampling_rate", base.sampling_rate)),
                   hop_length=int(cfg.get("hop_length", base.hop_length)), n_fft=int(cfg.get("n_fft", base.n_fft)),
                   chunk_length=int(cfg.get("chunk_length", base.chunk_length)))

    @property
    def num_samples(self) -> int:
        return self.chunk_length * self.sampling_rate


class Attention(nn.Module):
    """Whisper's encoder attention (no bias on ``k_proj``; queries scaled before the product)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj, self.q_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        d = dim // self.num_heads
        q = (self.q_proj(x) * d ** -0.5).view(n, self.num_heads, d).transpose(0, 1)  # [heads, N, d]
        k, v = (p(x).view(n, self.num_heads, d).transpose(0, 1) for p in (self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=1.0)[0]
        return self.out_proj(out.transpose(0, 1).reshape(n, dim))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


def num_positions(num_frames: int) -> int:
    """Encoder positions of ``num_frames`` real mel frames (the second conv halves the rate)."""
    return (num_frames - 1) // 2 + 1


def num_audio_tokens(num_frames: int) -> int:
    """The processor's audio-token count: positions, then pooled by two."""
    return (num_positions(num_frames) - 2) // 2 + 1


class AudioTower(nn.Module):
    """``Qwen2AudioEncoder``: log-mel frames ``[M, F]`` -> pooled features ``[T, D]``."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, mel: torch.Tensor, num_frames: int) -> torch.Tensor:
        """``mel [M, F']`` holds the clip's ``num_frames`` real frames and at least two more (or the whole chunk)."""
        n = num_positions(num_frames)
        x = F.gelu(self.conv1(mel[None]))
        # [N, D]: the positions the clip covers (transformers' encoder never applies its embed_scale)
        x = F.gelu(self.conv2(x))[0].transpose(0, 1)[:n]
        x = x + self.embed_positions.weight[:n]
        for layer in self.layers:
            x = layer(x)
        pooled = F.avg_pool1d(x.transpose(0, 1)[None], 2, stride=2)[0].transpose(0, 1)  # [N // 2, D]
        return self.layer_norm(pooled)[:num_audio_tokens(num_frames)]


class Qwen2AudioModel(nn.Module):
    def __init__(self, cfg: AudioConfig, text_hidden: int) -> None:
        super().__init__()
        self.audio_tower = AudioTower(cfg)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = nn.Linear(cfg.hidden_size, text_hidden)

    def forward(self, mel: torch.Tensor, num_frames: int) -> torch.Tensor:
        return self.multi_modal_projector.linear(self.audio_tower(mel, num_frames))


@attrs.define
class Qwen2AudioEncoder:
    model: Qwen2AudioModel
    features: FeatureExtraction
    placeholder_id: int
    device: torch.device

    @property
    def sampling_rate(self) -> int:
        return self.features.sampling_rate

    def input_features(self, audio: np.ndarray) -> tuple[np.ndarray, int]:
        """The log-mel frames the encoder needs ``[M, F']`` and the clip's number of real frames."""
        fe = self.features
        if audio.size > fe.num_samples:
            raise InvalidRequest(f"the audio is {audio.size / fe.sampling_rate:.1f} s long; this model takes at most "
                                 f"{fe.chunk_length} s")
        num_frames = -(-audio.size // fe.hop_length)
        mel = log_mel_features(audio, fe.num_mel_bins, num_samples=fe.num_samples,
                               num_frames=2 * num_positions(num_frames) + 2, n_fft=fe.n_fft,
                               hop_length=fe.hop_length, sampling_rate=fe.sampling_rate)
        return mel, num_frames

    @torch.inference_mode()
    def encode(self, item: MediaItem) -> EncodedMedia:
        mel, num_frames = self.input_features(item.data)
        if num_audio_tokens(num_frames) < 1:
            raise InvalidRequest("the audio clip is too short to encode")
        embeds = self.model(torch.from_numpy(mel).to(self.device), num_frames)
        return EncodedMedia(token_ids=(self.placeholder_id,) * embeds.shape[0], embed_token_id=self.placeholder_id,
                            embeds=embeds)


def load(path: Path, device: torch.device) -> LoadedVlm:
    cfg = read_json(path, "config.json")
    if "text_config" not in cfg:
        raise ValueError(f"{path}/config.json has no text_config")
    audio = AudioConfig.from_hf(cfg.get("audio_config") or {})
    files = ProcessorFiles.read(path)
    features = FeatureExtraction.from_hf(files.feature_extractor)
    if features.num_mel_bins != audio.num_mel_bins:
        raise ValueError(f"the feature extractor makes {features.num_mel_bins} mel bins; the encoder takes "
                         f"{audio.num_mel_bins}")
    if features.num_samples // features.hop_length != 2 * audio.max_source_positions:
        raise ValueError(f"the feature extractor's {features.chunk_length} s chunk is not the encoder's "
                         f"{2 * audio.max_source_positions} frames")
    tokenizer = load_tokenizer(path, cfg["text_config"], files.processor)
    token = cfg.get("audio_token_id", cfg.get("audio_token_index", 151646))
    audio_token_id = special_token_id(tokenizer, int(token), "audio_token_id")
    parts = split_state(load_state(path), {"audio": ("model.audio_tower.", "audio_tower."),
                                           "projector": ("model.multi_modal_projector.", "multi_modal_projector.")},
                        str(path))
    text_model = load_text_model(cfg["text_config"], parts["text"], tokenizer, path, device,
                                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    with torch.device("meta"):
        model = Qwen2AudioModel(audio, text_model.config.hidden_size)
    state = {**{f"audio_tower.{k}": v for k, v in parts["audio"].items()},
             **{f"multi_modal_projector.{k}": v for k, v in parts["projector"].items()}}
    model = load_module(model, state, f"{path} (audio tower and projector)", device)
    encoder = Qwen2AudioEncoder(model, features, audio_token_id, device)
    return LoadedVlm("qwen2_audio", text_model, tokenizer, {"audio": encoder})


FAMILY = Family(name="qwen2_audio", architectures=("Qwen2AudioForConditionalGeneration",), load=load,
                model_types=("qwen2_audio",))
