"""Qwen2-VL / Qwen2.5-VL image preprocessing, as ``Qwen2VLImageProcessor`` (its PIL backend) computes it.

An image keeps its aspect ratio: ``smart_resize`` picks the size nearest to
the original whose sides are multiples of ``patch_size * merge_size`` and
whose area lies in ``[min_pixels, max_pixels]``. The resized, rescaled and
normalized pixels are cut into ``patch_size`` squares, each repeated
``temporal_patch_size`` times (a still image is a clip of identical frames),
in the order the vision tower's patch merger expects: ``merge_size x
merge_size`` blocks of neighbouring patches are contiguous.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np
from PIL import Image

from ifb_plugins.common.media.image_ops import pixel_settings, resample_filter, resize, to_array, to_float, to_rgb

#: transformers' ``OPENAI_CLIP_MEAN`` / ``OPENAI_CLIP_STD``, the processor's defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)``: multiples of ``factor``, area within ``[min_pixels, max_pixels]``, aspect kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"the aspect ratio must be below {MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width):g}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@attrs.frozen
class QwenVLImageProcessing:
    """The settings of ``preprocessor_config.json`` (the ``Qwen2VLImageProcessor`` class defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: Image.Resampling = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> QwenVLImageProcessing:
        """Read a processor config: ``size`` (``shortest_edge`` / ``longest_edge``, or ``min_pixels`` /
        ``max_pixels``), overridden by top-level ``min_pixels`` / ``max_pixels`` as the processor does."""
        base = cls()
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or base.min_pixels
        max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or base.max_pixels
        return cls(
            min_pixels=int(min_pixels), max_pixels=int(max_pixels),
            patch_size=int(cfg.get("patch_size", base.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", base.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", base.merge_size)),
            resample=resample_filter(cfg.get("resample", base.resample)),
            do_resize=bool(cfg.get("do_resize", base.do_resize)),
            **pixel_settings(cfg, base),
        )

    @property
    def factor(self) -> int:
        """Image sides are multiples of this: one merged token covers ``factor x factor`` pixels."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``pixel_values [grid_h * grid_w, C * T * P * P]`` float32 and ``(grid_t, grid_h, grid_w)`` in patches."""
        pixels = to_array(to_rgb(image) if self.do_convert_rgb else image)  # [C, H, W] uint8
        if self.do_resize:
            pixels = resize(pixels, *self.resized_size(*pixels.shape[1:]), self.resample)
        return self.patchify(to_float(pixels, self))

    def patchify(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Cut ``[C, H, W]`` into rows of ``C * T * P * P``, merge blocks contiguous (the processor's order)."""
        c, height, width = pixels.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if height % (p * m) or width % (p * m):
            raise ValueError(f"an image of {height}x{width} is not a multiple of {p * m} pixels; "
                             "resizing is off in the image processor config")
        grid_h, grid_w = height // p, width // p
        patches = pixels.reshape(c, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))  # frames repeated
        return np.ascontiguousarray(patches.reshape(grid_h * grid_w, c * t * p * p)), (1, grid_h, grid_w)
