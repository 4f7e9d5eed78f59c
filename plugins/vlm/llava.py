"""LLaVA (``LlavaForConditionalGeneration``): a CLIP or SigLIP tower, a two-layer projector, a Llama-family decoder.

What the model computes (transformers' ``LlavaModel.get_image_features``): the
tower's hidden states at ``vision_feature_layer`` (an index into ``[embeddings,
layer 1, ..., layer L]``, usually negative, or a list of them concatenated along
the width), without the tower's final norm; ``vision_feature_select_strategy``
``default`` drops CLIP's class token, ``full`` keeps every token; then
``linear_2(act(linear_1(x)))``. The processor resizes (shortest edge, bicubic),
centre-crops, rescales and normalizes, and expands ``<image>`` into one image
token per feature.

Shape letters: N image tokens, D tower width, K selected layers, H decoder width.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np
import torch
from torch import nn

from ifb_plugins.vlm.checkpoint import (
    ProcessorFiles, load_module, load_state, load_text_model, load_tokenizer, read_json, special_token_id,
    split_state,
)
from ifb_plugins.common.media.image_ops import CLIP_DEFAULTS, IMAGE_PROCESSOR_DEFAULTS, SIGLIP_DEFAULTS, ImageProcessing
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.media.vision import VisionConfig, VisionTower, activation

log = logging.getLogger("ifb.vlm")

VISION_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


@attrs.frozen
class LlavaConfig:
    vision: VisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...]  # absolute indices into the tower's hidden states
    keeps_class_token: bool  # strategy "full" on a CLIP tower
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    image_seq_length: int | None = None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlavaConfig:
        vision = VisionConfig.from_hf(cfg.get("vision_config") or {}, default_type="clip_vision_model")
        raw_layer = cfg.get("vision_feature_layer", -2)
        layers = [raw_layer] if isinstance(raw_layer, int) else list(raw_layer)
        num_states = vision.num_layers + 1
        if not layers or any(not -num_states <= int(i) < num_states for i in layers):
            raise ValueError(f"vision_feature_layer {raw_layer!r} is outside the tower's {num_states} hidden states")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
        token = cfg.get("image_token_id", cfg.get("image_token_index", 32000))
        return cls(
            vision=vision, image_token_id=int(token),
            feature_layers=tuple(int(i) % num_states for i in layers),
            # "default" drops the first token whatever the tower; with SigLIP that is a patch (as transformers does)
            keeps_class_token=strategy == "full",
            projector_hidden_act=str(cfg.get("projector_hidden_act", "gelu")),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            image_seq_length=cfg.get("image_seq_length"),
        )

    @property
    def num_image_tokens(self) -> int:
        n = self.vision.grid ** 2 + int(self.vision.is_clip)
        return n if self.keeps_class_token else n - 1


class Projector(nn.Module):
    """``LlavaMultiModalProjector``: ``linear_2(act(linear_1(x)))``."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """The tower and the projector: pixel values ``[B, C, S, S]`` -> image features ``[B, N, H]``."""

    def __init__(self, cfg: LlavaConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = VisionTower(cfg.vision)
        width = cfg.vision.hidden_size * len(cfg.feature_layers)
        self.multi_modal_projector = Projector(width, text_hidden, cfg.projector_hidden_act, cfg.projector_bias)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[B, N, H]`` and each feature's importance ``[B, N]`` (see ``VisionTower.hidden_states``)."""
        cfg = self.config
        states, received = self.vision_tower.hidden_states(pixels, max(cfg.feature_layers))
        selected = [states[i] for i in cfg.feature_layers]  # K x [B, N + 1 or N, D]
        if not cfg.keeps_class_token:
            selected, received = [s[:, 1:] for s in selected], received[:, 1:]
        return self.multi_modal_projector(torch.cat(selected, dim=-1)), received  # [B, N, K*D] -> [B, N, H]


@attrs.define
class LlavaImageEncoder:
    """The processor's preprocessing and the tower + projector, for one image."""

    model: LlavaVision
    processing: ImageProcessing
    placeholder_id: int
    device: torch.device

    def pixel_values(self, item: MediaItem) -> np.ndarray:
        return self.processing(item.data)  # [C, S, S]

    @torch.inference_mode()
    def encode(self, item: MediaItem) -> EncodedMedia:
        pixels = torch.from_numpy(self.pixel_values(item))[None].to(self.device)
        embeds, importance = self.model(pixels)
        n = embeds.shape[1]
        return EncodedMedia(token_ids=(self.placeholder_id,) * n, embed_token_id=self.placeholder_id,
                            embeds=embeds[0], importance=importance[0])


def image_processing(files: ProcessorFiles, vision: VisionConfig) -> ImageProcessing:
    """The checkpoint's image processor (its class's defaults for what the file omits)."""
    kind = files.image_processor.get("image_processor_type")
    if kind is None:
        default = CLIP_DEFAULTS if vision.is_clip else SIGLIP_DEFAULTS
    elif kind in IMAGE_PROCESSOR_DEFAULTS:
        default = IMAGE_PROCESSOR_DEFAULTS[kind]
    else:
        raise ValueError(f"image processor {kind!r} is not supported for LLaVA "
                         f"(supported: {', '.join(sorted(IMAGE_PROCESSOR_DEFAULTS))})")
    processing = ImageProcessing.from_hf(files.image_processor, default)
    if not files.image_processor:  # no processor saved: size it for the tower
        side = {"height": vision.image_size, "width": vision.image_size}
        processing = attrs.evolve(processing, size={"shortest_edge": vision.image_size} if vision.is_clip else side,
                                  crop_size=side)
    if processing.do_center_crop:
        out = (processing.crop_size["height"], processing.crop_size["width"])
    elif "height" in processing.size and "width" in processing.size:
        out = (processing.size["height"], processing.size["width"])
    else:
        out = None
    if out != (vision.image_size, vision.image_size):
        raise ValueError(f"the image processor makes {out or 'variable-size'} images but the vision tower takes "
                         f"{vision.image_size}x{vision.image_size}")
    return processing


def load(path: Path, device: torch.device) -> LoadedVlm:
    cfg = read_json(path, "config.json")
    if "text_config" not in cfg:
        raise ValueError(f"{path}/config.json has no text_config")
    config = LlavaConfig.from_hf(cfg)
    files = ProcessorFiles.read(path)
    tokenizer = load_tokenizer(path, cfg["text_config"], files.processor)
    image_token_id = special_token_id(tokenizer, config.image_token_id, "image_token_id")
    parts = split_state(load_state(path), {"vision": VISION_PREFIXES, "projector": PROJECTOR_PREFIXES}, str(path))
    # SigLIP's pooling head is saved with the tower; LLaVA never runs it
    vision_state = {k: v for k, v in parts["vision"].items() if not k.startswith("head.")}
    text_model = load_text_model(cfg["text_config"], parts["text"], tokenizer, path, device,
                                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    with torch.device("meta"):
        vision = LlavaVision(config, text_model.config.hidden_size)
    state = {**{f"vision_tower.{k}": v for k, v in vision_state.items()},
             **{f"multi_modal_projector.{k}": v for k, v in parts["projector"].items()}}
    vision = load_module(vision, state, f"{path} (vision tower and projector)", device)
    if config.image_seq_length is not None and config.image_seq_length != config.num_image_tokens:
        log.info("%s: image_seq_length is %s; the tower gives %d image tokens per image", path,
                 config.image_seq_length, config.num_image_tokens)
    encoder = LlavaImageEncoder(vision, image_processing(files, config.vision), image_token_id, device)
    return LoadedVlm("llava", text_model, tokenizer, {"image": encoder})


FAMILY = Family(name="llava", architectures=("LlavaForConditionalGeneration",), load=load, model_types=("llava",))
