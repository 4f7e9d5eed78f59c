"""Gemma 4 (``Gemma4ForConditionalGeneration``): its vision encoder and audio conformer in front of the
Gemma 4 decoder (``ifb_plugins.common.models.gemma4``: sliding and full layers, KV sharing, per-layer
inputs, soft-capping).

What the model computes: the chat template renders ``<|image|>`` (``<|audio|>``)
once per item; the processor expands it to ``boi``, one ``image_token`` per soft
token, ``eoi`` (``boa`` / ``audio_token`` / ``eoa`` for audio). Each tower's
output goes through the multimodal embedder (a scale-free RMSNorm and a linear
projection into the text width) and replaces the placeholder rows of the
decoder's (already scaled) input embeddings. The per-layer inputs of those rows
are the pad token's: the decoder reads a media placeholder as the pad token
(``Gemma4Model(media_token_ids=...)``). Positions are the prompt positions.

Checkpoints whose text config sets ``use_bidirectional_attention: "vision"``
(image tokens attending to each other both ways in the sliding layers) are
refused at load: a prefill chunk may hold only part of an image here, so that
mask is not built.

transformers 5 saves ``model.language_model.*``, ``model.vision_tower.*``,
``model.embed_vision.*``, ``model.audio_tower.*``, ``model.embed_audio.*`` (and
``lm_head.weight`` unless tied).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
from torch import nn

from ifb.params import InvalidRequest
from ifb_plugins.common.media.gemma4_audio import Gemma4AudioConfig, Gemma4AudioFeatures, Gemma4AudioTower
from ifb_plugins.common.media.gemma4_vision import Gemma4ImageProcessing, Gemma4VisionConfig, Gemma4VisionTower
from ifb_plugins.common.media.gemma4_vision import RMSNorm
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.models.gemma4 import Gemma4Model, read_gemma4_config
from ifb_plugins.vlm.checkpoint import ProcessorFiles, load_module, load_state, load_tokenizer, read_json, \
    special_token_id, split_state
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm

ARCHITECTURES = ("Gemma4ForConditionalGeneration",)
PARTS = {"vision": ("model.vision_tower.",), "embed_vision": ("model.embed_vision.",),
         "audio": ("model.audio_tower.",), "embed_audio": ("model.embed_audio.",)}
TEXT_PREFIXES = (("model.language_model.", "model."), ("lm_head.", "lm_head."))


class MultimodalEmbedder(nn.Module):
    """``embed_vision`` / ``embed_audio``: a tower's outputs into the text width."""

    def __init__(self, dim: int, text_dim: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(dim, eps, with_scale=False)
        self.embedding_projection = nn.Linear(dim, text_dim, bias=False)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


@attrs.define
class Gemma4ImageEncoder:
    """The image processor, the vision tower and its embedder, for one image."""

    tower: Gemma4VisionTower
    embedder: MultimodalEmbedder
    processing: Gemma4ImageProcessing
    placeholder_id: int
    begin_id: int
    end_id: int
    device: torch.device

    def encode(self, item: MediaItem) -> EncodedMedia:
        try:
            patches, positions = self.processing(item.data)
        except ValueError as exc:
            raise InvalidRequest(f"this image cannot be processed: {exc}") from None
        soft, importance = self.tower(torch.from_numpy(patches).to(self.device),
                                      torch.from_numpy(positions).to(self.device))
        embeds = self.embedder(soft)  # [M, H]
        ids = (self.begin_id, *(self.placeholder_id,) * embeds.shape[0], self.end_id)
        return EncodedMedia(token_ids=ids, embed_token_id=self.placeholder_id, embeds=embeds, importance=importance)


@attrs.define
class Gemma4AudioEncoder:
    """The feature extractor, the audio conformer and its embedder, for one clip."""

    tower: Gemma4AudioTower
    embedder: MultimodalEmbedder
    features: Gemma4AudioFeatures
    placeholder_id: int
    begin_id: int
    end_id: int
    device: torch.device

    @property
    def sampling_rate(self) -> int:
        return self.features.sampling_rate

    def encode(self, item: MediaItem) -> EncodedMedia:
        try:
            features, mask = self.features(item.data)
        except ValueError as exc:
            raise InvalidRequest(f"this audio clip cannot be processed: {exc}") from None
        soft = self.tower(torch.from_numpy(features).to(self.device), torch.from_numpy(mask).to(self.device))
        if soft.shape[0] == 0:
            raise InvalidRequest("this audio clip is too short to give any audio tokens")
        embeds = self.embedder(soft)  # [N, H]
        ids = (self.begin_id, *(self.placeholder_id,) * embeds.shape[0], self.end_id)
        return EncodedMedia(token_ids=ids, embed_token_id=self.placeholder_id, embeds=embeds)


def load_audio_encoder(path: Path, cfg: Mapping[str, Any], text_hidden: int, state: Mapping[str, dict],
                       files: ProcessorFiles, tokenizer, device: torch.device) -> Gemma4AudioEncoder:
    audio = Gemma4AudioConfig.from_hf(cfg["audio_config"])
    kind = files.feature_extractor.get("feature_extractor_type")
    if kind not in (None, "Gemma4AudioFeatureExtractor"):
        raise ValueError(f"feature extractor {kind!r} is not supported for Gemma 4 (Gemma4AudioFeatureExtractor)")
    features = Gemma4AudioFeatures.from_hf(files.feature_extractor)
    if features.feature_size != audio.subsampling_conv_channels[0]:
        raise ValueError(f"the feature extractor gives {features.feature_size} mel bins; the audio tower's "
                         f"subsampling takes {audio.subsampling_conv_channels[0]}")
    with torch.device("meta"):
        tower = Gemma4AudioTower(audio)
        embedder = MultimodalEmbedder(audio.output_proj_dims, text_hidden, audio.rms_norm_eps)
    return Gemma4AudioEncoder(
        load_module(tower, state["audio"], f"{path} (audio tower)", device),
        load_module(embedder, state["embed_audio"], f"{path} (audio embedder)", device), features,
        _token(tokenizer, cfg, "audio_token_id", "audio_token_id"), _token(tokenizer, cfg, "boa_token_id", "boa_token_id"),
        _token(tokenizer, cfg, "eoa_token_index", "eoa_token_index"), device)


def text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    text = dict(cfg.get("text_config") or {})
    if text.get("use_bidirectional_attention") == "vision":
        raise ValueError("config.json: text_config.use_bidirectional_attention 'vision' (image tokens attending "
                         "both ways in the sliding layers) is not served: a prefill chunk may split an image")
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return text


def _token(tokenizer, cfg: Mapping[str, Any], key: str, what: str) -> int:
    if cfg.get(key) is None:
        raise ValueError(f"config.json has no {key}")
    return special_token_id(tokenizer, int(cfg[key]), what)


def load(path: Path, device: torch.device) -> LoadedVlm:
    cfg = read_json(path, "config.json")
    text = text_config(cfg)
    config = read_gemma4_config(text)
    files = ProcessorFiles.read(path)
    tokenizer = load_tokenizer(path, text, files.processor)
    state = split_state(load_state(path), PARTS, where=str(path), text_prefixes=TEXT_PREFIXES)
    encoders: dict[str, Any] = {}
    media_ids = [int(cfg[k]) for k in ("image_token_id", "audio_token_id", "video_token_id") if cfg.get(k) is not None]
    with torch.device("meta"):
        decoder = Gemma4Model(config, media_token_ids=tuple(media_ids))
    if config.tie_word_embeddings:
        state["text"].pop("lm_head.weight", None)
    decoder = load_module(decoder, state["text"], f"{path} (language model)", device)
    if cfg.get("vision_config") is not None:
        vision = Gemma4VisionConfig.from_hf(cfg["vision_config"])
        with torch.device("meta"):
            tower = Gemma4VisionTower(vision)
            embedder = MultimodalEmbedder(vision.hidden_size, config.hidden_size, vision.rms_norm_eps)
        kind = files.image_processor.get("image_processor_type")
        if kind not in (None, "Gemma4ImageProcessor", "Gemma4ImageProcessorPil"):
            raise ValueError(f"image processor {kind!r} is not supported for Gemma 4 (Gemma4ImageProcessor)")
        processing = Gemma4ImageProcessing.from_hf(files.image_processor)
        if processing.patch_size != vision.patch_size or processing.pooling_kernel_size != vision.pooling_kernel_size:
            raise ValueError(f"the image processor cuts {processing.patch_size}-pixel patches pooled "
                             f"{processing.pooling_kernel_size}x{processing.pooling_kernel_size}; the tower takes "
                             f"{vision.patch_size} pooled {vision.pooling_kernel_size}x{vision.pooling_kernel_size}")
        encoders["image"] = Gemma4ImageEncoder(
            load_module(tower, state["vision"], f"{path} (vision tower)", device),
            load_module(embedder, state["embed_vision"], f"{path} (vision embedder)", device), processing,
            _token(tokenizer, cfg, "image_token_id", "image_token_id"),
            _token(tokenizer, cfg, "boi_token_id", "boi_token_id"),
            _token(tokenizer, cfg, "eoi_token_id", "eoi_token_id"), device)
    if cfg.get("audio_config") is not None:
        encoders["audio"] = load_audio_encoder(path, cfg, config.hidden_size, state, files, tokenizer, device)
    if not encoders:
        raise ValueError(f"{path}: a Gemma 4 image-text checkpoint without vision_config or audio_config")
    return LoadedVlm("gemma4", decoder, tokenizer, encoders, embed=decoder.embed)


FAMILY = Family(name="gemma4", architectures=ARCHITECTURES, load=load, model_types=("gemma4",))
