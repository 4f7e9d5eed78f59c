"""A tiny random ``Qwen3_5ForConditionalGeneration`` and its processor, as transformers saves them.

The model is transformers' class (Gated DeltaNet and gated attention layers, interleaved M-RoPE, the
Qwen3-VL-style tower without DeepStack), saved with ``save_pretrained``; the processor is transformers'
``Qwen3VLProcessor`` (the one ``AutoProcessor`` picks for ``qwen3_5``) with its PIL image processor, written
by its own serialization (``to_json_file``; ``save_pretrained`` needs the video processor, hence
torchvision). The tokenizer is the shared tiny BPE plus Qwen's vision tokens, with Qwen2-VL's chat
template (the same image placeholders Qwen3.5's template renders).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from tests.models.hybrid import _redraw
from tests.plugins.vlm import tiny
from tests.plugins.vlm.tiny_qwen2_5_vl import (EOS_TOKEN_ID, IMAGE_TOKEN_ID, QWEN2_VL_CHAT_TEMPLATE, VIDEO_TOKEN_ID,
                                              VISION_END_ID, VISION_START_ID, VISION_TOKENS)

__all__ = ["IMAGE_TOKEN_ID", "load_processor", "save_tiny_qwen3_5_vl"]

LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")


def tiny_config(moe: bool = False):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = dict(vocab_size=320, hidden_size=64, num_hidden_layers=len(LAYER_TYPES), layer_types=list(LAYER_TYPES),
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=2048, bos_token_id=0, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
                # a rotary width of 8 (head_dim 16, partial 0.5): 4 frequencies over the three rows
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    shared_expert_intermediate_size=40)
    else:
        text.update(intermediate_size=96)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return cls(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
               vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)


@contextlib.contextmanager
def _without_video_processor() -> Iterator[None]:
    # The video processor needs torchvision, which this environment lacks; the processor's class check
    # would refuse its absence although images and text never touch it.
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if name == "video_processor" and arg is None else original(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


def load_processor(directory: str | Path):
    """transformers' ``Qwen3VLProcessor`` (PIL image processor, no video) from a saved directory."""
    from transformers import PreTrainedTokenizerFast, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(directory))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    with _without_video_processor():
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                chat_template=tokenizer.chat_template)


def save_tiny_qwen3_5_vl(directory: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """Save the tiny model (text weights redrawn as the hybrid fixtures', the tower's with fan-in scaling),
    its processor (32-pixel merged tokens, 4 to 24 per image) and tokenizer; returns the directory."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(tiny_config(moe)).float().eval()
    _redraw(model, seed, mamba_heads=0)
    tiny.redraw(model.model.visual, seed + 1)
    model.save_pretrained(str(directory))
    tokenizer = tiny.tiny_tokenizer(*VISION_TOKENS)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    from transformers import Qwen3VLProcessor

    image_processor = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 24)
    with _without_video_processor():
        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                     chat_template=QWEN2_VL_CHAT_TEMPLATE)
    # its own serialization, as save_pretrained writes processor_config.json (which needs the video processor)
    processor.to_json_file(str(directory / "processor_config.json"))
    return directory
