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

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.deepstack import build_text_model
from ifb_plugins.vlm.checkpoint import ProcessorFiles, load_module, load_state, load_tokenizer, read_json, \
    special_token_id
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.vlm.qwen2_5_vl import image_processing, split_state
from ifb_plugins.common.media.qwen2_5_vl_image import QwenVLImageProcessing
from ifb_plugins.common.media.qwen2_5_vl_vision import encode_image
from ifb_plugins.common.media.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

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


@attrs.define
class Qwen3ImageEncoder:
    """The image processor's preprocessing and the tower, for one image; rows carry the DeepStack features."""

    tower: Qwen3VisionTower
    processing: QwenVLImageProcessing
    placeholder_id: int
    device: torch.device

    def encode(self, item: MediaItem) -> EncodedMedia:
        (merged, deepstack, importance), position_ids = encode_image(self.tower, self.processing, item.data,
                                                                     self.device)
        rows = torch.cat([merged, *deepstack], dim=-1)  # [M, (K + 1) H]
        return EncodedMedia(token_ids=(self.placeholder_id,) * rows.shape[0], embed_token_id=self.placeholder_id,
                            embeds=rows, importance=importance, position_ids=position_ids)


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
