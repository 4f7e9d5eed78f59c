"""A tiny random ``Gemma4ForConditionalGeneration`` (vision and audio towers) and its processor, as
transformers saves them.

The model is transformers' class with the text features of ``tests.models.gemma4`` (sliding and full
layers, KV sharing, per-layer inputs, soft-capping), a vision tower with clipped linears and
standardized outputs, and an audio conformer; saved with ``save_pretrained``. The processor is
transformers' ``Gemma4Processor`` over its PIL image processor, its audio feature extractor and the
tokenizer, written by its own serialization (``to_json_file``: ``processor_config.json`` with the parts
nested, as ``save_pretrained`` writes it; that one needs the video processor, hence torchvision). The tokenizer is the shared tiny BPE plus Gemma 4's media tokens.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import torch

from tests.models.gemma4 import LAYER_TYPES, SLIDING_WINDOW, _redraw
from tests.models.text import SPECIAL_TOKENS, train_tiny_tokenizer

#: the media tokens, in id order after the tiny tokenizer's 300, with the tokenizer attribute naming each
MEDIA_TOKENS = (("image_token", "<|image|>"), ("boi_token", "<|image>"), ("eoi_token", "<image|>"),
                ("audio_token", "<|audio|>"), ("boa_token", "<|audio>"), ("eoa_token", "<audio|>"),
                ("video_token", "<|video|>"))
IMAGE_TOKEN_ID, BOI_ID, EOI_ID, AUDIO_TOKEN_ID, BOA_ID, EOA_ID, VIDEO_TOKEN_ID = range(300, 307)
EOS_TOKEN_ID = 2
#: Gemma's turn markup, images and audio rendered where their parts are
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<|image|>"
    "{% elif item['type'] == 'audio' %}<|audio|>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: 4-pixel patches pooled 3x3: at most 70 soft tokens (transformers' smallest budget) of 12x12 pixels
PATCH_SIZE, POOLING, MAX_SOFT_TOKENS = 4, 3, 70
MEL_BINS = 32


def tiny_config(*, audio: bool = True):
    from transformers import Gemma4Config

    text = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, sliding_window=SLIDING_WINDOW,
        vocab_size_per_layer_input=320, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
        final_logit_softcapping=30.0, attention_k_eq_v=True, use_double_wide_mlp=True,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=EOS_TOKEN_ID, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=PATCH_SIZE, pooling_kernel_size=POOLING,
                  position_embedding_size=64, use_clipped_linears=True, standardize=True)
    # the subsampling's first width is the mel bins (its projection takes width / 4 * second width inputs)
    audio_cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     subsampling_conv_channels=[MEL_BINS, 8],
                     conv_kernel_size=5, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
                     output_proj_dims=48, use_clipped_linears=True) if audio else None
    return Gemma4Config(text_config=text, vision_config=vision, audio_config=audio_cfg,
                        image_token_id=IMAGE_TOKEN_ID, boi_token_id=BOI_ID, eoi_token_id=EOI_ID,
                        audio_token_id=AUDIO_TOKEN_ID, boa_token_id=BOA_ID, eoa_token_index=EOA_ID,
                        video_token_id=VIDEO_TOKEN_ID, tie_word_embeddings=True)


def tiny_tokenizer():
    import transformers
    from tokenizers import AddedToken

    tok = train_tiny_tokenizer(300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in MEDIA_TOKENS])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0],
        extra_special_tokens={role: t for role, t in MEDIA_TOKENS if role != "video_token"})


@torch.no_grad()
def _redraw_towers(model, seed: int) -> None:
    """Fan-in scaled tower weights, norms near one, and clipping bounds that clip (not infinite)."""
    gen = torch.Generator().manual_seed(seed)
    for tower in (model.model.vision_tower, model.model.audio_tower, model.model.embed_vision,
                  model.model.embed_audio):
        if tower is None:
            continue
        for name, p in [*tower.named_parameters(), *tower.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "output_min"):
                p.fill_(-2.5)
            elif leaf in ("input_max", "output_max"):
                p.fill_(2.5)
            elif leaf == "std_scale":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() <= 1:
                p.copy_((1.0 if "norm" in name or "scale" in leaf else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif "position_embedding_table" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))


@contextlib.contextmanager
def _without_video_processor() -> Iterator[None]:
    # The video processor needs torchvision, which this environment lacks; the processor's class check
    # would refuse its absence although images, audio and text never touch it.
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
    """transformers' ``Gemma4Processor`` (PIL image processor, audio feature extractor, no video) from a dir."""
    from transformers import Gemma4Processor, PreTrainedTokenizerFast
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    with _without_video_processor():
        return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor.from_pretrained(str(directory)),
                               image_processor=Gemma4ImageProcessorPil.from_pretrained(str(directory)),
                               tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template)


def save_tiny_gemma4_vlm(directory: str | Path, seed: int = 0, *, audio: bool = True) -> Path:
    """Save the tiny model, its processor's parts and tokenizer (with the chat template); returns the dir."""
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    directory = Path(directory)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(tiny_config(audio=audio)).float().eval()
    _redraw(model.model.language_model, seed)
    _redraw_towers(model, seed + 1)
    model.save_pretrained(str(directory))
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    from transformers import Gemma4Processor

    with _without_video_processor():
        processor = Gemma4Processor(
            feature_extractor=Gemma4AudioFeatureExtractor(feature_size=MEL_BINS), tokenizer=tokenizer, video_processor=None,
            image_processor=Gemma4ImageProcessorPil(patch_size=PATCH_SIZE, pooling_kernel_size=POOLING,
                                                    max_soft_tokens=MAX_SOFT_TOKENS),
            chat_template=CHAT_TEMPLATE)
    processor.to_json_file(str(directory / "processor_config.json"))
    return directory
