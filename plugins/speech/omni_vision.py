"""The Qwen3-Omni Thinker's image input: Qwen2-VL's image preprocessing and its vision encoder (``thinker.visual.*``).

``Qwen3OmniMoeVisionEncoder`` computes what Qwen3-VL's tower does (patch
embedding plus bilinearly resized learned positions, a 2-D rotary ViT over the
whole image, a 2x2 patch merger and DeepStack mergers after
``deepstack_visual_indexes`` blocks): the shared ``Qwen3VisionTower`` runs it.
Only the mergers' parameter names differ (``ln_q``, ``mlp.0``, ``mlp.2``,
``merger_list``), renamed on load.

An image's row is ``[embedding | DeepStack feature 1 | ... | K]``
(``common.deepstack``); its tokens' M-RoPE ids are its merged grid's (frame,
row, column), after the text before it (``get_rope_index``; an image's one frame
sits at temporal id 0, whatever ``position_id_per_seconds``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import torch

from ifb_plugins.common.loading.processor import ProcessorFiles
from ifb_plugins.common.media.qwen2_5_vl_image import QwenVLImageProcessing
from ifb_plugins.common.media.qwen2_5_vl_vision import encode_image
from ifb_plugins.common.media.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower
from ifb_plugins.speech.weights import adopt, load_prefixed

IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast")
_MERGER = {"ln_q": "norm", "mlp.0": "linear_fc1", "mlp.2": "linear_fc2"}


def tower_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``thinker.visual.*`` names as ``Qwen3VisionTower`` has them."""
    out = {}
    for name, tensor in state.items():
        match = re.match(r"^(merger|merger_list\.\d+)\.(ln_q|mlp\.0|mlp\.2)\.(weight|bias)$", name)
        if match:
            owner = match[1].replace("merger_list", "deepstack_merger_list")
            name = f"{owner}.{_MERGER[match[2]]}.{match[3]}"
        out[name] = tensor
    return out


def image_processing(path: Path, vision: Qwen3VisionConfig) -> QwenVLImageProcessing:
    """The checkpoint's image processor settings (either processor file), which must cut the tower's patches."""
    files = ProcessorFiles.read(path)
    raw, file = files.image_processor, files.image_source or str(path)
    kind = raw.get("image_processor_type")
    if kind is not None and kind not in IMAGE_PROCESSORS:
        raise ValueError(f"{file}: image processor {kind!r} is not supported (Qwen2VLImageProcessor)")
    processing = QwenVLImageProcessing.from_hf(raw)
    got = (processing.patch_size, processing.merge_size, processing.temporal_patch_size)
    want = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    if got != want:
        raise ValueError(f"{file}: the image processor cuts (patch, merge, temporal) {got} but the vision "
                         f"encoder takes {want}")
    return processing


@attrs.frozen
class EncodedImage:
    rows: torch.Tensor = attrs.field(eq=False)  # [M, (K + 1) H]
    position_ids: torch.Tensor = attrs.field(eq=False)  # [3, M], relative to the image's first token


@attrs.define
class OmniImageEncoder:
    """Preprocessing and the tower, for one image."""

    tower: Qwen3VisionTower
    processing: QwenVLImageProcessing

    @property
    def num_deepstack(self) -> int:
        return len(self.tower.config.deepstack_visual_indexes)

    def encode(self, image: Any, device: torch.device) -> EncodedImage:
        (merged, deepstack, _), position_ids = encode_image(self.tower, self.processing, image, device)
        return EncodedImage(torch.cat([merged, *deepstack], dim=-1), position_ids)


def load_image_encoder(path: Path, raw: dict[str, Any]) -> OmniImageEncoder:
    """The Thinker's vision encoder (``thinker.visual.*``) and its image processor's settings."""
    vision = Qwen3VisionConfig.from_hf(raw["thinker_config"].get("vision_config") or {})
    tower = adopt(lambda: Qwen3VisionTower(vision), tower_state(load_prefixed(path, "thinker.visual.")),
                  "vision encoder")
    return OmniImageEncoder(tower, image_processing(path, vision))
