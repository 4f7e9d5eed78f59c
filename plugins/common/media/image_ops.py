"""Image preprocessing as the Hugging Face image processors compute it, with Pillow and numpy.

Each step mirrors the PIL backend of ``transformers``' image processors step for
step, including its dtypes: resizing runs in Pillow on 8-bit pixels, rescaling
multiplies in float64 and rounds to float32, normalizing subtracts and divides in
float32. Arrays are channels-first ``[C, H, W]``.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import numpy as np
from PIL import Image

#: ``resample`` codes of the processors' configs (PIL's own enum values)
RESAMPLING = {int(r): r for r in Image.Resampling}


def resample_filter(code: Any) -> Image.Resampling:
    try:
        return RESAMPLING[int(code)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"image processor resample {code!r} is not a PIL resampling filter") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited over white (the processors' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def to_array(image: Image.Image) -> np.ndarray:
    """``[C, H, W]`` uint8."""
    return np.moveaxis(np.asarray(image), -1, 0)


def resize(pixels: np.ndarray, height: int, width: int, resample: Image.Resampling) -> np.ndarray:
    """Resize ``[C, H, W]`` uint8 pixels in Pillow."""
    image = Image.fromarray(np.ascontiguousarray(np.moveaxis(pixels, 0, -1)))
    return to_array(image.resize((width, height), resample=resample))


def shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """The size whose shorter side is ``shortest``, the longer one scaled and truncated (torchvision's rule)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest * long / short)
    return (new_long, shortest) if width <= height else (shortest, new_long)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Crop the centre ``height x width``, zero-padding first where the image is smaller."""
    _, h, w = pixels.shape
    if h < height or w < width:
        new_h, new_w = max(h, height), max(w, width)
        padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
        top, left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)
        padded[:, top:top + h, left:left + w] = pixels
        pixels, h, w = padded, new_h, new_w
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top:top + height, left:left + width]


def pad_to_square(pixels: np.ndarray, background: tuple[int, ...]) -> np.ndarray:
    """Centre the image on a square of its longer side filled with ``background`` (LLaVA's ``do_pad``)."""
    c, h, w = pixels.shape
    if h == w:
        return pixels
    side = max(h, w)
    out = np.empty((c, side, side), dtype=pixels.dtype)
    out[:] = np.asarray(background, dtype=pixels.dtype).reshape(-1, 1, 1)
    if w > h:
        top = (side - h) // 2
        out[:, top:top + h, :] = pixels
    else:
        left = (side - w) // 2
        out[:, :, left:left + w] = pixels
    return out


def rescale(pixels: np.ndarray, factor: float) -> np.ndarray:
    return (pixels.astype(np.float64) * factor).astype(np.float32)


def normalize(pixels: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    pixels = pixels.astype(np.float32) if not np.issubdtype(pixels.dtype, np.floating) else pixels
    mean_a, std_a = np.asarray(mean, dtype=pixels.dtype), np.asarray(std, dtype=pixels.dtype)
    return ((pixels.T - mean_a) / std_a).T


def to_float(pixels: np.ndarray, settings: Any) -> np.ndarray:
    """``[C, H, W]`` uint8 as float32, rescaled and normalized as ``settings`` (``do_rescale``,
    ``rescale_factor``, ``do_normalize``, ``image_mean``, ``image_std``) say."""
    out = rescale(pixels, settings.rescale_factor) if settings.do_rescale else pixels.astype(np.float32)
    return normalize(out, settings.image_mean, settings.image_std) if settings.do_normalize else out


def pixel_settings(cfg: Mapping[str, Any], base: Any) -> dict[str, Any]:
    """The RGB, rescale and normalize settings of a processor config, read as every processor reads
    them; what ``cfg`` omits keeps ``base``'s."""
    return dict(
        do_rescale=bool(cfg.get("do_rescale", base.do_rescale)),
        rescale_factor=float(cfg.get("rescale_factor", base.rescale_factor)),
        do_normalize=bool(cfg.get("do_normalize", base.do_normalize)),
        image_mean=tuple(float(x) for x in cfg.get("image_mean", base.image_mean)),
        image_std=tuple(float(x) for x in cfg.get("image_std", base.image_std)),
        do_convert_rgb=bool(cfg.get("do_convert_rgb", base.do_convert_rgb)),
    )


def _size(raw: Any, where: str) -> dict[str, int]:
    if isinstance(raw, int):
        return {"height": raw, "width": raw}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a size dict, got {raw!r}")
    return {k: int(v) for k, v in raw.items() if v is not None}


@attrs.frozen
class ImageProcessing:
    """The settings of a CLIP-, SigLIP- or LLaVA-style image processor (``preprocessor_config.json``)."""

    size: dict[str, int] = attrs.field(factory=lambda: {"shortest_edge": 224})
    resample: Image.Resampling = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    crop_size: dict[str, int] = attrs.field(factory=lambda: {"height": 224, "width": 224})
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    do_convert_rgb: bool = True
    do_pad: bool = False

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], defaults: ImageProcessing | None = None) -> ImageProcessing:
        """Read a processor's settings; what it omits keeps ``defaults`` (its class's defaults)."""
        base = defaults or cls()
        return cls(
            size=_size(cfg["size"], "size") if "size" in cfg else base.size,
            resample=resample_filter(cfg["resample"]) if "resample" in cfg else base.resample,
            do_resize=bool(cfg.get("do_resize", base.do_resize)),
            do_center_crop=bool(cfg.get("do_center_crop", base.do_center_crop)),
            crop_size=_size(cfg["crop_size"], "crop_size") if cfg.get("crop_size") else base.crop_size,
            **pixel_settings(cfg, base),
            do_pad=bool(cfg.get("do_pad", base.do_pad) or False),
        )

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` of an image after resizing."""
        size = self.size
        if "shortest_edge" in size:
            return shortest_edge_size(height, width, size["shortest_edge"])
        if "height" in size and "width" in size:
            return size["height"], size["width"]
        raise ValueError(f"image processor size {size} is not supported (shortest_edge, or height and width)")

    def __call__(self, image: Image.Image) -> np.ndarray:
        """Pixel values ``[C, H, W]`` float32 of one image, as the processor computes them."""
        pixels = to_array(to_rgb(image) if self.do_convert_rgb else image)
        if self.do_pad:
            background = tuple(int(x * 255) for x in self.image_mean)
            pixels = pad_to_square(pixels, background)
        if self.do_resize:
            pixels = resize(pixels, *self.output_size(*pixels.shape[1:]), self.resample)
        if self.do_center_crop:
            pixels = center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        return to_float(pixels, self)


SIGLIP_DEFAULTS = ImageProcessing(size={"height": 224, "width": 224}, do_center_crop=False,
                                  image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
CLIP_DEFAULTS = ImageProcessing()

#: the defaults of each ``image_processor_type`` this plugin implements (the PIL backends' class attributes)
IMAGE_PROCESSOR_DEFAULTS = {
    f"{name}{suffix}": defaults
    for name, defaults in (("CLIPImageProcessor", CLIP_DEFAULTS), ("LlavaImageProcessor", CLIP_DEFAULTS),
                           ("SiglipImageProcessor", SIGLIP_DEFAULTS))
    for suffix in ("", "Pil", "Fast")
}
