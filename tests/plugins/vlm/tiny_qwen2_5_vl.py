"""A tiny random ``Qwen2_5_VLForConditionalGeneration`` and its processor, as transformers saves them.

The model and the image processor are transformers' own classes
(``save_pretrained``); the tokenizer is the shared tiny BPE plus Qwen's vision
special tokens, with Qwen2-VL's chat template. Nothing here writes a weight
layout: ``layout="hub"`` is what ``save_pretrained`` writes (``visual.*``,
``model.*``), ``layout="modules"`` the model's own module names
(``model.visual.*``, ``model.language_model.*``), saved with transformers'
weight conversions turned off.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Literal

from tests.plugins.vlm import tiny

#: Qwen2-VL / Qwen2.5-VL's chat template as the hub ships it
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: the vision special tokens, in id order after the tiny tokenizer's 300
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 300, 301, 302, 303
EOS_TOKEN_ID = 2  # <|im_end|>
#: small images stay small: 4 to 24 merged tokens of 28x28 pixels
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 24


def tiny_config(**vision: Any):
    from transformers import Qwen2_5_VLConfig

    vision_config = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                         patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                         window_size=56, fullatt_block_indexes=[1])  # windows of 2x2 merged tokens
    vision_config.update(vision)
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=vision_config,
        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)


@contextlib.contextmanager
def _without_video_processor() -> Iterator[None]:
    # The video processor needs torchvision, which this environment lacks; the processor's
    # class check would refuse its absence although images and text never touch it.
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        return None if name == "video_processor" and arg is None else original(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original


def load_processor(directory: str | Path, family: Literal["qwen2_5_vl", "qwen3_vl"] = "qwen2_5_vl"):
    """transformers' ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` (PIL image processor, no video) from a dir."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(directory))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    cls = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen3VLProcessor
    with _without_video_processor():
        return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                   chat_template=tokenizer.chat_template)


def save_tiny_qwen2_5_vl(directory: str | Path, seed: int = 0, layout: Literal["hub", "modules"] = "hub",
                         **vision: Any) -> Path:
    """Save a tiny random model, its image processor and tokenizer (with the chat template); returns the dir."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(**vision)).eval()
    tiny.redraw(model, seed)
    if layout == "modules":
        model._weight_conversions = []  # no renaming on save: the module tree's names
    model.save_pretrained(str(directory))
    tokenizer = tiny.tiny_tokenizer(*VISION_TOKENS)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(str(directory))
    return directory


def tiny_qwen3_config():
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=EOS_TOKEN_ID, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)


def save_tiny_qwen3_vl(directory: str | Path, seed: int = 0) -> Path:
    """A tiny random ``Qwen3VLForConditionalGeneration`` (two DeepStack layers), its image processor
    (32-pixel merged tokens) and tokenizer, with the Qwen2-VL chat template (the same image placeholders)."""
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_config()).eval()
    tiny.redraw(model, seed)
    model.save_pretrained(str(directory))
    tokenizer = tiny.tiny_tokenizer(*VISION_TOKENS)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 24).save_pretrained(
        str(directory))
    return directory
