"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a windowed 2D-rotary ViT, a patch merger, Qwen2's decoder
with M-RoPE.

What the model computes: the image processor resizes each image to its own
size (``smart_resize``: sides multiples of 28 pixels, area within
``[min_pixels, max_pixels]``) and cuts it into 14x14 patches; the tower
(``qwen2_5_vl_vision``) merges each 2x2 block of patches into one embedding.
The chat template renders ``<|vision_start|><|image_pad|><|vision_end|>`` per
image and the processor repeats ``<|image_pad|>`` once per embedding. The
decoder's rotary positions are three rows (``ifb_plugins.common.layers.mrope``): an
image's tokens carry its grid's rows and columns, the text after it continues
from the largest id + 1.

transformers writes (and the hub holds) ``visual.*``, ``model.*`` (the text
decoder) and ``lm_head.weight``; a model saved from its module tree instead
has ``model.visual.*`` and ``model.language_model.*``. Both load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.loading.checkpoint import LoadedCheckpoint, build_model
from ifb_plugins.vlm.checkpoint import ProcessorFiles, load_module, load_state, load_tokenizer, read_json, \
    special_token_id
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.media.qwen2_5_vl_image import QwenVLImageProcessing
from ifb_plugins.common.media.qwen2_5_vl_vision import Qwen2_5VisionConfig, Qwen2_5VisionTower, encode_image

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


@attrs.frozen
class Qwen2_5VLConfig:
    text: TextModelConfig
    vision: Qwen2_5VisionConfig
    image_token_id: int
    vision_start_token_id: int | None
    vision_end_token_id: int | None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Qwen2_5VLConfig:
        if "vision_config" not in cfg:
            raise ValueError("config.json has no vision_config")
        return cls(
            text=text_config(cfg),
            vision=Qwen2_5VisionConfig.from_hf(cfg["vision_config"]),
            image_token_id=int(cfg.get("image_token_id", 151655)),
            vision_start_token_id=cfg.get("vision_start_token_id"),
            vision_end_token_id=cfg.get("vision_end_token_id"),
        )


def text_config(cfg: Mapping[str, Any]) -> TextModelConfig:
    """The decoder's config: Qwen2's layers with M-RoPE over ``mrope_section``.

    transformers 5 nests it in ``text_config``; older configs keep it flat at the top level.
    """
    text = dict(cfg.get("text_config") or cfg)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    if not section:
        raise ValueError("the text config has no rope_parameters.mrope_section (M-RoPE)")
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default", None):
        rope["rope_type"] = "default"
        rope.pop("type", None)
    rope.setdefault("rope_theta", text.get("rope_theta", 1000000.0))
    text.pop("rope_scaling", None)
    text.update(model_type="qwen2", rope_parameters=rope)
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    config = TextModelConfig.from_hf_config(text)
    return attrs.evolve(config, mrope_section=tuple(int(n) for n in section),
                        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.tie_word_embeddings)))


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(text, vision)`` state dicts in our names: the text model's ``model.*`` / ``lm_head.*``, the tower's own."""
    text: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    stray: list[str] = []
    for name, tensor in state.items():
        if name.startswith(("visual.", "model.visual.")):
            vision[name.split("visual.", 1)[1]] = tensor
        elif name.startswith("model.language_model."):
            text["model." + name.removeprefix("model.language_model.")] = tensor
        elif name.startswith(("model.", "lm_head.")):
            text[name] = tensor
        else:
            stray.append(name)
    if stray:
        raise ValueError(f"unexpected weights outside visual.*, model.*, lm_head.*: {', '.join(sorted(stray)[:5])}")
    if not vision:
        raise ValueError("no visual.* weights (the vision tower)")
    return text, vision


@attrs.define
class QwenImageEncoder:
    """The image processor's preprocessing and the tower, for one image; its tokens carry M-RoPE ids."""

    tower: Qwen2_5VisionTower
    processing: QwenVLImageProcessing
    placeholder_id: int
    device: torch.device

    def encode(self, item: MediaItem) -> EncodedMedia:
        (embeds, importance), position_ids = encode_image(self.tower, self.processing, item.data, self.device)
        return EncodedMedia(token_ids=(self.placeholder_id,) * embeds.shape[0], embed_token_id=self.placeholder_id,
                            embeds=embeds, importance=importance, position_ids=position_ids)  # [M, H], [M], [3, M]


def image_processing(files: ProcessorFiles, vision: Qwen2_5VisionConfig) -> QwenVLImageProcessing:
    """The checkpoint's image processor, which must cut the patches the tower takes."""
    kind = files.image_processor.get("image_processor_type")
    if kind is not None and kind not in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil",
                                         "Qwen2VLImageProcessorFast"):
        raise ValueError(f"image processor {kind!r} is not supported for Qwen2.5-VL and Qwen3-VL (Qwen2VLImageProcessor)")
    processing = QwenVLImageProcessing.from_hf(files.image_processor)
    got = (processing.patch_size, processing.merge_size, processing.temporal_patch_size)
    want = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    if got != want:
        raise ValueError(f"the image processor cuts (patch, merge, temporal) {got} but the vision tower takes {want}")
    return processing


def load(path: Path, device: torch.device) -> LoadedVlm:
    cfg = read_json(path, "config.json")
    config = Qwen2_5VLConfig.from_hf(cfg)
    files = ProcessorFiles.read(path)
    tokenizer = load_tokenizer(path, cfg.get("text_config") or cfg, files.processor)
    image_token_id = special_token_id(tokenizer, config.image_token_id, "image_token_id")
    text_state, vision_state = split_state(load_state(path))
    text_model = build_model(LoadedCheckpoint(config.text, text_state, tokenizer, "hf", path), device=device)
    with torch.device("meta"):
        tower = Qwen2_5VisionTower(config.vision)
    tower = load_module(tower, vision_state, f"{path} (vision tower)", device)
    encoder = QwenImageEncoder(tower, image_processing(files, config.vision), image_token_id, device)
    return LoadedVlm("qwen2_5_vl", text_model, tokenizer, {"image": encoder})


FAMILY = Family(name="qwen2_5_vl", architectures=ARCHITECTURES, load=load, model_types=("qwen2_5_vl",))
