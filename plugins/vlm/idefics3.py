"""SmolVLM and Idefics3 (``SmolVLMForConditionalGeneration``, ``Idefics3ForConditionalGeneration``).

What the processor does to one image (``Idefics3ImageProcessorPil``): resize so
the longest edge is ``size.longest_edge`` (the other edge scaled, rounded up to
even), then, with ``do_image_splitting``, up to multiples of the tile side M
(``max_image_size.longest_edge``) and cut into rows x cols tiles of M x M plus
the whole image resized to M x M as a global view (an image no larger than M is
its own single frame); without splitting, one M x M frame. Every frame is
rescaled and normalized. The prompt's ``<image>`` becomes, per tile,
``<fake_token_around_image><row_r_col_c>`` + ``<image>`` x S, a newline after each
row, then ``\\n<fake_token_around_image><global-img>`` + ``<image>`` x S +
``<fake_token_around_image>`` (no tiles: the global part without the newline).

What the model does to each frame: SigLIP embeddings whose positions are
bucketed onto the learned grid, the encoder, ``post_layernorm``, a pixel shuffle
that folds each ``scale_factor`` x ``scale_factor`` block of patches into one token
(S = (M / patch)^2 / scale^2 tokens of width D * scale^2) and a bias-free linear
projection.

Shape letters: F frames, G patch grid side, D tower width, H decoder width.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np
import torch
from PIL import Image
from torch import nn

from ifb_plugins.common.media import image_ops
from ifb_plugins.vlm.checkpoint import (
    TEXT_MODEL_PREFIXES, ProcessorFiles, load_module, load_state, load_text_model, load_tokenizer, read_json,
    special_token_id, split_state,
)
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.media.vision import VisionConfig, VisionTower

FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<image>", "<global-img>"
MAX_IMAGE_SIZE = 4096  # the processor's cap on a resized side


@attrs.frozen
class TileProcessing:
    """``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor`` settings (their class defaults where omitted)."""

    longest_edge: int | None = 4 * 364
    tile_side: int = 364
    resample: Image.Resampling = Image.Resampling.LANCZOS
    do_image_splitting: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> TileProcessing:
        base = cls()
        size = cfg.get("size") or {}
        if cfg.get("do_resize", True) and size and "longest_edge" not in size:
            raise ValueError(f"image processor size {size} is not supported (longest_edge)")
        return cls(
            longest_edge=int(size.get("longest_edge", base.longest_edge)) if cfg.get("do_resize", True) else None,
            tile_side=int((cfg.get("max_image_size") or {}).get("longest_edge", base.tile_side)),
            resample=image_ops.resample_filter(cfg["resample"]) if "resample" in cfg else base.resample,
            do_image_splitting=bool(cfg.get("do_image_splitting", base.do_image_splitting)),
            **image_ops.pixel_settings(cfg, base),
        )

    def _longest_edge_size(self, height: int, width: int) -> tuple[int, int]:
        aspect = width / height
        if width >= height:
            width = self.longest_edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = self.longest_edge
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height  # then below the absolute cap
        if width >= height and width > MAX_IMAGE_SIZE:
            width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
        elif height > width and height > MAX_IMAGE_SIZE:
            height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
        return max(height, 1), max(width, 1)

    def _tile_multiple_size(self, height: int, width: int) -> tuple[int, int]:
        m, aspect = self.tile_side, width / height
        if width >= height:
            width = math.ceil(width / m) * m
            height = math.ceil(int(width / aspect) / m) * m
        else:
            height = math.ceil(height / m) * m
            width = math.ceil(int(height * aspect) / m) * m
        return height, width

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, int, int]:
        """Frames ``[F, C, M, M]`` float32 (tiles row by row, then the global view), rows, cols."""
        pixels = image_ops.to_array(image_ops.to_rgb(image) if self.do_convert_rgb else image)
        if self.longest_edge is not None:
            pixels = image_ops.resize(pixels, *self._longest_edge_size(*pixels.shape[1:]), self.resample)
        m = self.tile_side
        rows = cols = 0
        if self.do_image_splitting:
            pixels = image_ops.resize(pixels, *self._tile_multiple_size(*pixels.shape[1:]), self.resample)
            height, width = pixels.shape[1:]
            if height > m or width > m:
                rows, cols = (height - m) // m + 1, (width - m) // m + 1
                frames = [pixels[:, r * m:(r + 1) * m, c * m:(c + 1) * m] for r in range(rows) for c in range(cols)]
                frames.append(image_ops.resize(pixels, m, m, self.resample))
            else:
                frames = [pixels]
        else:
            frames = [image_ops.resize(pixels, m, m, self.resample)]
        return np.stack([image_ops.to_float(frame, self) for frame in frames]), rows, cols


def bucketed_position_ids(grid: int, num_positions_side: int, device: torch.device) -> torch.Tensor:
    """``Idefics3VisionEmbeddings``' position ids ``[G*G]`` for a frame of ``grid`` x ``grid`` real patches."""
    boundaries = torch.arange(1 / num_positions_side, 1.0, 1 / num_positions_side, device=device)
    step = 1.0 / torch.tensor([grid], device=device)
    coords = torch.clamp(torch.arange(grid, device=device, dtype=torch.float32)[None, :] * step[:, None],
                         max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)[0]  # [G]
    return (buckets[:, None] * num_positions_side + buckets[None, :]).reshape(-1)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``Idefics3Connector.pixel_shuffle``: ``[F, G*G, D]`` -> ``[F, G*G / scale^2, D * scale^2]``."""
    f, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(f, side, side, dim).view(f, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(f, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(f, seq // (scale * scale), dim * scale * scale)


class Idefics3Vision(nn.Module):
    """``vision_model`` and ``connector``: frames ``[F, C, M, M]`` -> image features ``[F, S, H]``."""

    def __init__(self, vision: VisionConfig, scale_factor: int, text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.vision_model = VisionTower(vision)
        self.connector = nn.Module()
        self.connector.modality_projection = nn.Module()
        self.connector.modality_projection.proj = nn.Linear(vision.hidden_size * scale_factor ** 2, text_hidden,
                                                            bias=False)

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[F, S, H]`` and each feature's importance ``[F, S]`` (its patches' attention, summed)."""
        tower, cfg = self.vision_model, self.vision_model.config
        grid = frames.shape[-1] // cfg.patch_size
        positions = bucketed_position_ids(grid, cfg.grid, frames.device).expand(frames.shape[0], -1)
        states, received = tower.hidden_states(frames, cfg.num_layers, positions)
        x = tower.post_layernorm(states[-1])  # [F, G*G, D]
        shuffled = pixel_shuffle(x, self.scale_factor)
        importance = pixel_shuffle(received[..., None], self.scale_factor).sum(-1)
        return self.connector.modality_projection.proj(shuffled), importance


@attrs.define
class Idefics3ImageEncoder:
    model: Idefics3Vision
    processing: TileProcessing
    tokenizer: Any
    placeholder_id: int
    image_seq_len: int
    device: torch.device

    def pixel_values(self, item: MediaItem) -> tuple[np.ndarray, int, int]:
        return self.processing(item.data)

    def prompt(self, rows: int, cols: int) -> str:
        """The processor's replacement for one ``<image>``."""
        image = IMAGE_TOKEN * self.image_seq_len
        global_view = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{image}{FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return global_view
        tiles = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                        for r in range(rows))
        return f"{tiles}\n{global_view}"

    @torch.inference_mode()
    def encode(self, item: MediaItem) -> EncodedMedia:
        frames, rows, cols = self.pixel_values(item)
        embeds, importance = self.model(torch.from_numpy(frames).to(self.device))
        ids = tuple(self.tokenizer.encode(self.prompt(rows, cols), add_special_tokens=False))
        return EncodedMedia(token_ids=ids, embed_token_id=self.placeholder_id, embeds=embeds.flatten(0, 1),
                            importance=importance.flatten())


def load(path: Path, device: torch.device) -> LoadedVlm:
    cfg = read_json(path, "config.json")
    if "text_config" not in cfg or "vision_config" not in cfg:
        raise ValueError(f"{path}/config.json needs a text_config and a vision_config")
    vision = VisionConfig.from_hf(cfg["vision_config"], default_type="idefics3_vision")
    scale = int(cfg.get("scale_factor", 2))
    files = ProcessorFiles.read(path)
    processing = TileProcessing.from_hf(files.image_processor)
    grid = processing.tile_side // vision.patch_size
    if processing.tile_side % vision.patch_size or grid % scale:
        raise ValueError(f"tiles of {processing.tile_side} px do not make a patch grid divisible by the "
                         f"scale factor {scale}")
    image_seq_len = grid * grid // (scale * scale)
    declared = files.processor.get("image_seq_len")
    if declared is not None and int(declared) != image_seq_len:
        raise ValueError(f"the processor's image_seq_len {declared} is not the model's {image_seq_len} "
                         "tokens per tile")
    tokenizer = load_tokenizer(path, cfg["text_config"], files.processor)
    image_token_id = special_token_id(tokenizer, int(cfg.get("image_token_id", 128257)), "image_token_id")
    for token in (FAKE_TOKEN, GLOBAL_TOKEN):
        special_token_id(tokenizer, token, "the image wrapper token")
    parts = split_state(load_state(path), {"vision": ("model.vision_model.",), "connector": ("model.connector.",)},
                        str(path), text_prefixes=TEXT_MODEL_PREFIXES)
    text_model = load_text_model(cfg["text_config"], parts["text"], tokenizer, path, device,
                                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    with torch.device("meta"):
        model = Idefics3Vision(vision, scale, text_model.config.hidden_size)
    state = {**{f"vision_model.{k}": v for k, v in parts["vision"].items()},
             **{f"connector.{k}": v for k, v in parts["connector"].items()}}
    model = load_module(model, state, f"{path} (vision model and connector)", device)
    encoder = Idefics3ImageEncoder(model, processing, tokenizer, image_token_id, image_seq_len, device)
    return LoadedVlm("idefics3", text_model, tokenizer, {"image": encoder})


FAMILY = Family(name="idefics3", load=load,
                architectures=("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
                model_types=("idefics3", "smolvlm"))
