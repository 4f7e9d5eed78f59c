"""Reading a ``Qwen2_5_VLForConditionalGeneration`` checkpoint: its config and its two weight layouts.

transformers writes (and the hub holds) ``visual.*``, ``model.*`` (the text
decoder) and ``lm_head.weight``; a model saved from its module tree instead
has ``model.visual.*`` and ``model.language_model.*``. Both load.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import torch

from ifb_plugins.common.config import TextModelConfig
from ifb_plugins.vlm.qwen2_5_vl_vision import Qwen2_5VisionConfig

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
