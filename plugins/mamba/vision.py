"""Image input for Qwen3.5's image-text model (``Qwen3_5ForConditionalGeneration`` and its MoE sibling).

The tower is Qwen3-VL's without DeepStack (``ifb_plugins.common.media.qwen3_vl_vision``),
the preprocessing ``Qwen2VLImageProcessor``'s (``qwen2_5_vl_image``), the placeholder
expansion and per-step splice the shared media layer's (``media.prompt``). An image's
tokens carry interleaved M-RoPE ids (``layers.mrope``): its grid's rows and columns
from the position after the text before it; the text after it continues from the
largest id + 1, as ``Qwen3_5Model.get_rope_index`` computes for still images.

The image-text model lives in this plugin, not the vlm one, because its decoder is
the hybrid one: a request's recurrent state is held per seat, checkpointed for prefix
reuse and recomputed after preemption by this plugin's runtime. What the image path
needs from the vlm side is shared already (``ifb_plugins.common.media``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Prepared
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.common.media.parts import MediaItem, parse_messages
from ifb_plugins.common.media.prompt import MediaSpan, expand_media
from ifb_plugins.common.media.qwen2_5_vl_image import QwenVLImageProcessing
from ifb_plugins.common.media.qwen2_5_vl_vision import encode_image
from ifb_plugins.common.media.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

#: the image processors whose patches the tower takes
IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast")


def read_image_processor(path: Path) -> dict[str, Any]:
    """The image processor's saved settings, as transformers finds them: nested in ``processor_config.json``
    (transformers 5), else ``preprocessor_config.json``. The one place this plugin reads them."""
    import json

    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        file = path / name
        if file.exists():
            settings = json.loads(file.read_text())
            settings = settings.get(key) or {} if key else settings
            if settings:
                return dict(settings)
    raise FileNotFoundError(f"{path}: no image processor settings (preprocessor_config.json)")


def image_processing(settings: Mapping[str, Any], vision: Qwen3VisionConfig) -> QwenVLImageProcessing:
    """The checkpoint's image processor, which must cut the patches the tower takes."""
    kind = settings.get("image_processor_type")
    if kind is not None and kind not in IMAGE_PROCESSORS:
        raise ValueError(f"image processor {kind!r} is not supported for Qwen3.5 (Qwen2VLImageProcessor)")
    processing = QwenVLImageProcessing.from_hf(settings)
    got = (processing.patch_size, processing.merge_size, processing.temporal_patch_size)
    want = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    if got != want:
        raise ValueError(f"the image processor cuts (patch, merge, temporal) {got} but the vision tower takes {want}")
    return processing


@attrs.define
class ImageInput:
    """The tower, the preprocessing and the image placeholder of one image-text checkpoint."""

    tower: Qwen3VisionTower
    processing: QwenVLImageProcessing
    image_token_id: int
    device: torch.device
    allowed_dir: Path | None = None

    def span(self, item: MediaItem) -> MediaSpan:
        """One image as its placeholder expands: a placeholder per merged token, with M-RoPE ids."""
        (embeds, _, _), position_ids = encode_image(self.tower, self.processing, item.data, self.device)
        rows = torch.arange(embeds.shape[0], dtype=torch.long)
        return MediaSpan((self.image_token_id,) * embeds.shape[0], rows, embeds, position_ids)

    def prepare(self, spec: RequestSpec, tokenizer: TextTokenizer, *, max_model_len: int,
                dtype: torch.dtype) -> Prepared | None:
        """A chat with image parts rendered and expanded (None: the request is not a chat)."""
        if spec.messages is None:
            return None
        parsed = parse_messages(spec.messages, modalities={"image"}, sampling_rate=16000,
                                allowed_dir=self.allowed_dir,
                                allow_hint="start the server with --allowed-local-media-path DIR")
        messages = list(parsed.messages)
        if any(t in (tokenizer.chat_template or "") for t in ("'type'", '"type"', ".type")):
            # a template written for content parts: a string content is one text part, as OpenAI defines it
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                        if isinstance(m.get("content"), str) else m for m in messages]
        text = _render(tokenizer, messages, spec)
        ids = tokenizer.encode(text, add_special_tokens=False)
        found = [(i, "image") for i, t in enumerate(ids) if t == self.image_token_id]
        if len(found) != len(parsed.media):
            token = tokenizer.id_to_token(self.image_token_id)
            raise InvalidRequest(f"the prompt has {len(found)} image placeholders for {len(parsed.media)} images: "
                                 f"remove {token!r} from the message text")
        prepared = Prepared(tuple(ids))
        if not parsed.media:
            return prepared
        return expand_media(prepared, found, parsed.media, self.span, max_model_len=max_model_len,
                            device=self.device, dtype=dtype)


def _render(tokenizer: TextTokenizer, messages: list[dict], spec: RequestSpec) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             **(spec.chat_template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - the template's own error is the message
        raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc


def load_image_input(path: Path, cfg: Mapping[str, Any], state: dict[str, torch.Tensor], tokenizer: TextTokenizer,
                     device: torch.device, allowed_dir: Path | None = None) -> ImageInput:
    """Build the tower from ``vision_config`` and its weights (strictly), with the checkpoint's processor."""
    vision_cfg = cfg.get("vision_config")
    if not isinstance(vision_cfg, Mapping):
        raise ValueError(f"{path}: config.json has no vision_config")
    # Qwen3.5's tower has no DeepStack mergers (Qwen3-VL's config default lists three)
    vision = Qwen3VisionConfig.from_hf({**vision_cfg, "deepstack_visual_indexes": []})
    image_token_id = int(cfg.get("image_token_id", -1))
    if image_token_id not in tokenizer.tokenizer.get_added_tokens_decoder():
        raise ValueError(f"{path}: image_token_id {image_token_id} is not a special token of the tokenizer")
    with torch.device("meta"):
        tower = Qwen3VisionTower(vision)
    expected = set(tower.state_dict())
    if expected != set(state):
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{path} (vision tower): the weights do not match vision_config: "
                         f"missing {missing[:5]}, unexpected {extra[:5]}")
    tower.load_state_dict(state, strict=True, assign=True)
    tower = tower.float().eval().to(device)
    processing = image_processing(read_image_processor(path), vision)
    return ImageInput(tower, processing, image_token_id, torch.device(device), allowed_dir)
