"""Tiny random multimodal checkpoints built and saved by transformers' own model and processor classes.

Nothing here writes a checkpoint layout: the model is transformers' class,
saved with ``save_pretrained`` (the transformers 5 layout), or, for the hub's
older layout, saved with the weight conversions transformers itself records
when it loads such a checkpoint (it writes the names back as they were read).
Weights are redrawn with fan-in scaling so that logits are far from uniform and
greedy picks are not decided by rounding.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
import transformers
from tokenizers import AddedToken
from transformers.conversion_mapping import get_model_conversion_mapping

from ifb_plugins.common.testing import SPECIAL_TOKENS, train_tiny_tokenizer

#: LLaVA's hub template, reading string or list content
LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

TEXT_SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
VISION_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def tiny_tokenizer(*extra: str) -> transformers.PreTrainedTokenizerFast:
    """The shared tiny BPE (ChatML specials at 0, 1, 2) with ``extra`` special tokens after its 300 ids."""
    tok = train_tiny_tokenizer(300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0],
        extra_special_tokens={"image_token": extra[0]} if extra else None)


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> None:
    """Fan-in scaled weights, norms near one (not exactly: a dropped norm weight must show), small biases."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and ("norm" in name or "layrnorm" in name):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif p.ndim == 1:
            value = (0.02 if name.endswith("bias") else 0.5) * torch.randn(p.shape, generator=gen)
        else:
            rows = any(k in name for k in ("embed_tokens", "position_embedding", "embed_positions", "probe"))
            fan_in = p.shape[-1] if rows else p[0].numel()
            value = torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)
        p.copy_(value)


def save(model: transformers.PreTrainedModel, processor, directory: Path, layout: Literal["v5", "hub"]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "hub":
        # what transformers records when it loads a hub checkpoint, so that saving writes its names back
        model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def llava(directory: Path, *, tower: Literal["clip", "siglip"] = "clip", layout: Literal["v5", "hub"] = "v5",
          feature_layer: int | list[int] = -2, strategy: str = "default", seed: int = 0) -> Path:
    """A tiny ``LlavaForConditionalGeneration`` (32x32 images in 8x8 patches) and its ``LlavaProcessor``."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = tiny_tokenizer("<image>")
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    if tower == "clip":
        vision = transformers.CLIPVisionConfig(**VISION_SIZES, image_size=32, patch_size=8)
        image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        vision = transformers.SiglipVisionConfig(**VISION_SIZES, image_size=32, patch_size=8)
        image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    num_tokens = 16 + (tower == "clip") - (strategy == "default")
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=transformers.LlamaConfig(**TEXT_SIZES, bos_token_id=0, eos_token_id=2),
        image_token_index=image_token_id, vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy, image_seq_length=num_tokens)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    redraw(model, seed)
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy=strategy,
        num_additional_image_tokens=int(tower == "clip"), chat_template=LLAVA_TEMPLATE)
    return save(model, processor, directory, layout)


def reference(directory: Path, cls: type) -> tuple[transformers.PreTrainedModel, transformers.ProcessorMixin]:
    """The checkpoint loaded back by transformers (strictly: a missing or unexpected weight fails)."""
    model, info = cls.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval(), transformers.AutoProcessor.from_pretrained(directory)
