"""pi0's input processing as ``PI0Processor`` computes it: camera images, the prompt and the state.

The image processor is transformers' torchvision backend (``PI0ImageProcessor``): the image as 8-bit
channels-first pixels, resized to fit ``max_height`` x ``max_width`` with its aspect ratio kept
(bicubic with antialiasing, on 8-bit pixels as torchvision does on the CPU), rescaled and normalized
in one float32 step, then padded with zeros at the bottom and right to ``pad_size``. The prompt is
``<image>`` times ``image_seq_length`` per camera, then ``<bos>``, the task and a newline. The state
is normalized with the processor's dataset statistics when it has them, then zero-padded to
``max_state_dim``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ifb_plugins.common.loading.processor import ProcessorFiles
from ifb_plugins.common.media.image_ops import to_array, to_rgb

#: PIL's resample codes -> ``torch.nn.functional.interpolate`` modes (torchvision's mapping)
_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def _pair(raw: Mapping[str, Any] | None, keys: tuple[str, str], default: int) -> tuple[int, int]:
    raw = raw or {}
    return int(raw.get(keys[0], default)), int(raw.get(keys[1], default))


@attrs.frozen
class Pi0Processing:
    """The settings of a saved ``PI0Processor`` (``processor_config.json``) and how it applies them."""

    image_seq_length: int = 256
    max_size: tuple[int, int] = (224, 224)  # (max_height, max_width)
    pad_size: tuple[int, int] | None = (224, 224)
    resample: str = "bicubic"
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True
    state_mean: tuple[float, ...] | None = None
    state_std: tuple[float, ...] | None = None
    max_state_dim: int = 32

    @classmethod
    def from_dir(cls, path: str | Path) -> Pi0Processing:
        """The saved processor's settings, from either processor file (``ProcessorFiles``)."""
        files = ProcessorFiles.read(path)
        cfg, image = files.processor, files.image_processor
        resample = int(image.get("resample", 3))
        if resample not in _MODES:
            raise ValueError(f"pi0 image processor resample {resample} is not supported (0, 2 or 3)")
        size = image.get("size") or {}
        max_size = (_pair(size, ("max_height", "max_width"), 224) if "max_height" in size
                    else _pair(size, ("height", "width"), 224))
        stats = {k: tuple(float(x) for x in cfg[k]) if cfg.get(k) is not None else None
                 for k in ("state_mean", "state_std")}
        return cls(
            image_seq_length=int(image.get("image_seq_length", 256)), max_size=max_size,
            pad_size=_pair(image.get("pad_size"), ("height", "width"), 224) if image.get("do_pad", True) else None,
            resample=_MODES[resample], do_resize=bool(image.get("do_resize", True)),
            do_rescale=bool(image.get("do_rescale", True)), rescale_factor=float(image.get("rescale_factor", 1 / 255)),
            do_normalize=bool(image.get("do_normalize", True)),
            image_mean=tuple(float(x) for x in image.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(x) for x in image.get("image_std", (0.5, 0.5, 0.5))),
            do_convert_rgb=bool(image.get("do_convert_rgb", True)),
            max_state_dim=int(cfg.get("max_state_dim", 32)), **stats,
        )

    # -- images --

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' ``get_image_size_for_max_height_width``: fit the box, aspect ratio kept."""
        scale = min(self.max_size[0] / height, self.max_size[1] / width)
        return int(height * scale), int(width * scale)

    def image(self, image: Image.Image) -> torch.Tensor:
        """One camera image as pixel values ``[3, pad height, pad width]`` float32."""
        pixels = torch.from_numpy(np.ascontiguousarray(to_array(to_rgb(image) if self.do_convert_rgb else image)))
        if self.do_resize:
            size = self.resized_size(*pixels.shape[1:])
            if size != tuple(pixels.shape[1:]):
                antialias = self.resample != "nearest"
                pixels = F.interpolate(pixels[None], size=size, mode=self.resample, antialias=antialias,
                                       align_corners=False if antialias else None)[0]
        values = pixels.to(torch.float32)
        mean, std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
        if self.do_normalize:
            if self.do_rescale:  # one step, as the torchvision backend fuses them
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            values = values.sub_(mean[:, None, None]).div_(std[:, None, None])
        elif self.do_rescale:
            values = values * self.rescale_factor
        if self.pad_size is not None:
            extra_h, extra_w = self.pad_size[0] - values.shape[1], self.pad_size[1] - values.shape[2]
            values = F.pad(values, (0, extra_w, 0, extra_h))
        return values

    # -- the prompt and the state --

    def prompt(self, task: str, num_images: int, image_token: str, bos_token: str) -> str:
        return f"{image_token * self.image_seq_length * num_images}{bos_token}{task}\n"

    @property
    def state_dim(self) -> int | None:
        """The state's length when the processor normalizes it (its statistics' length), else None."""
        return len(self.state_mean) if self.state_mean is not None and self.state_std is not None else None

    def state(self, values: tuple[float, ...]) -> torch.Tensor:
        """``[max_state_dim]`` float32: normalized with the dataset statistics (if any), zero-padded."""
        state = torch.tensor(values, dtype=torch.float32)
        if self.state_dim is not None:
            state = (state - torch.tensor(self.state_mean)) / (torch.tensor(self.state_std) + 1e-08)
        return F.pad(state, (0, self.max_state_dim - state.shape[0]))
