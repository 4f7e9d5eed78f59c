"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen2.5-VL's image pipeline with a Qwen3 decoder, interleaved
M-RoPE and DeepStack.

What differs from Qwen2.5-VL (``qwen2_5_vl``): the tower (``qwen3_vl_vision``:
16-pixel patches, learned positions, no windows); the decoder is Qwen3's
(per-head q/k norm) and its M-RoPE interleaves the three position rows over the
rotary frequencies; and DeepStack: the tower's features from some of its middle
blocks are added to the image tokens' hidden states after the decoder's first
layers (one tower block per decoder layer). The image processor, the chat
template's placeholders and the position ids are the same.

DeepStack's features travel with the image embeddings: an image token's row is
``[embedding | feature 1 | ... | feature K]`` (``[N, (K + 1) H]``), the
decoder's token embedding is zero-padded to that width, and ``DeepStackTextModel``
splits the columns again, so scattering, chunked prefill and pruning treat the
row as one.

Shape letters: T tokens in the step, H hidden size, K DeepStack layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb.params import InvalidRequest
from ifb_plugins.common.attention import AttnMetadata
from ifb_plugins.common.config import TextModelConfig
from ifb_plugins.common.model import KVCache, TextModel, rope_inv_freq
from ifb_plugins.common.mrope import grid_ids
from ifb_plugins.vlm.checkpoint import ProcessorFiles, load_module, load_state, load_tokenizer, read_json, \
    special_token_id
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm
from ifb_plugins.vlm.media import MediaItem
from ifb_plugins.vlm.qwen2_5_vl import image_processing, split_state
from ifb_plugins.vlm.qwen2_5_vl_image import QwenVLImageProcessing
from ifb_plugins.vlm.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

ARCHITECTURES = ("Qwen3VLForConditionalGeneration",)


def text_config(cfg: Mapping[str, Any]) -> TextModelConfig:
    """Qwen3's layers with interleaved M-RoPE over ``mrope_section``."""
    text = dict(cfg.get("text_config") or {})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)  # Qwen3-VL's rotary interleaves whatever the flag says
    if not section:
        raise ValueError("the text config has no rope_parameters.mrope_section (M-RoPE)")
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default", None):
        rope["rope_type"] = "default"
        rope.pop("type", None)
    rope.setdefault("rope_theta", text.get("rope_theta", 5000000.0))
    text.pop("rope_scaling", None)
    text.update(model_type="qwen3", rope_parameters=rope)
    config = TextModelConfig.from_hf_config(text)
    return attrs.evolve(config, mrope_section=tuple(int(n) for n in section), mrope_interleaved=True,
                        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.tie_word_embeddings)))


class PaddedEmbedding(nn.Embedding):
    """Token embeddings ``[T, H]`` zero-padded to an image row's ``(K + 1) H`` columns (no DeepStack features)."""

    def __init__(self, num_embeddings: int, dim: int, extra: int) -> None:
        super().__init__(num_embeddings, dim)
        self.extra = extra

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.pad(super().forward(ids), (0, self.extra))


class DeepStackTextModel(TextModel):
    """The shared decoder, adding DeepStack feature ``i`` to the hidden states after layer ``i``."""

    def __init__(self, config: TextModelConfig, num_deepstack: int) -> None:
        super().__init__(config)
        if num_deepstack > config.num_layers:
            raise ValueError(f"{num_deepstack} DeepStack layers for a decoder of {config.num_layers}")
        self.num_deepstack = num_deepstack
        self.model.embed_tokens = PaddedEmbedding(config.vocab_size, config.hidden_size,
                                                  num_deepstack * config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnMetadata,
                kv_caches: list[KVCache], input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As ``TextModel.forward``; ``input_embeds`` rows are ``[embedding | DeepStack features]``."""
        rows = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, (K+1) H]
        h = self.config.hidden_size
        x = rows[:, :h].contiguous()  # [T, H]
        deepstack = rows[:, h:].view(rows.shape[0], self.num_deepstack, h)  # [T, K, H], zeros on text rows
        cos, sin = self.rotary(positions, x.dtype, None)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, attn, kv_cache)
            if i < self.num_deepstack:
                x = x + deepstack[:, i]
        return self.model.norm(x)


def build_text_model(config: TextModelConfig, num_deepstack: int, state: dict[str, torch.Tensor],
                     device: torch.device) -> DeepStackTextModel:
    """``common.loader.build_model`` for the DeepStack decoder: strict, float32."""
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = DeepStackTextModel(config, num_deepstack)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = torch.empty(0)
    model = model.to(device=device, dtype=torch.float32)
    model.inv_freq = rope_inv_freq(config).to(device)  # derived, never read from the checkpoint
    return model.eval()


@attrs.define
class Qwen3ImageEncoder:
    """The image processor's preprocessing and the tower, for one image; rows carry the DeepStack features."""

    tower: Qwen3VisionTower
    processing: QwenVLImageProcessing
    placeholder_id: int
    device: torch.device

    @torch.inference_mode()
    def encode(self, item: MediaItem) -> EncodedMedia:
        try:
            pixels, grid = self.processing(item.data)
        except ValueError as exc:  # an aspect ratio the processor refuses
            raise InvalidRequest(f"this image cannot be processed: {exc}") from None
        merged, deepstack, importance = self.tower(torch.from_numpy(pixels).to(self.device), grid)
        rows = torch.cat([merged, *deepstack], dim=-1)  # [M, (K + 1) H]
        merge = self.tower.config.spatial_merge_size
        return EncodedMedia(token_ids=(self.placeholder_id,) * rows.shape[0], embed_token_id=self.placeholder_id,
                            embeds=rows, importance=importance,
                            position_ids=grid_ids(grid[0], grid[1] // merge, grid[2] // merge))


def load(path: Path, device: torch.device) -> LoadedVlm:
    cfg = read_json(path, "config.json")
    if "vision_config" not in cfg or "text_config" not in cfg:
        raise ValueError(f"{path}/config.json needs a text_config and a vision_config")
    text = text_config(cfg)
    vision = Qwen3VisionConfig.from_hf(cfg["vision_config"])
    files = ProcessorFiles.read(path)
    tokenizer = load_tokenizer(path, cfg["text_config"], files.processor)
    image_token_id = special_token_id(tokenizer, int(cfg.get("image_token_id", 151655)), "image_token_id")
    text_state, vision_state = split_state(load_state(path))
    text_model = build_text_model(text, len(vision.deepstack_visual_indexes), text_state, device)
    with torch.device("meta"):
        tower = Qwen3VisionTower(vision)
    tower = load_module(tower, vision_state, f"{path} (vision tower)", device)
    encoder = Qwen3ImageEncoder(tower, image_processing(files, vision), image_token_id, device)
    return LoadedVlm("qwen3_vl", text_model, tokenizer, {"image": encoder})


FAMILY = Family(name="qwen3_vl", architectures=ARCHITECTURES, load=load, model_types=("qwen3_vl",))
