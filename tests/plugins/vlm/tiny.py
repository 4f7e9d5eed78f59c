"""Tiny random multimodal checkpoints built and saved by transformers' own model and processor classes.

Nothing here writes a checkpoint layout: the model is transformers' class,
saved with ``save_pretrained`` (the transformers 5 layout), or, for the hub's
older layout, saved with the weight conversions transformers itself records
when it loads such a checkpoint (it writes the names back as they were read).
Weights are redrawn with fan-in scaling so that logits are far from uniform and
greedy picks are not decided by rounding.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Literal

import torch
import transformers
from tokenizers import AddedToken
from transformers.conversion_mapping import get_model_conversion_mapping

from tests.models.text import SPECIAL_TOKENS, train_tiny_tokenizer

#: llava-hf/llava-1.5-7b-hf's template (images first, then text; ``{% generation %}`` around replies)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

#: SmolVLM-Instruct's hub template
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

TEXT_SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
VISION_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def tiny_tokenizer(*extra: str, role: str = "image_token") -> transformers.PreTrainedTokenizerFast:
    """The shared tiny BPE (ChatML specials at 0, 1, 2) with ``extra`` special tokens after its 300 ids;
    the first is the tokenizer's ``role`` (its ``image_token`` or ``audio_token``)."""
    tok = train_tiny_tokenizer(300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0],
        extra_special_tokens={role: extra[0]} if extra else None)


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
          feature_layer: int | list[int] = -2, strategy: str = "default", pad: bool = False, seed: int = 0) -> Path:
    """A tiny ``LlavaForConditionalGeneration`` (32x32 images in 8x8 patches) and its ``LlavaProcessor``
    (with ``pad``, ``LlavaImageProcessor`` padding images to a square first)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = tiny_tokenizer("<image>")
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    if tower == "clip":
        vision = transformers.CLIPVisionConfig(**VISION_SIZES, image_size=32, patch_size=8)
        kind = LlavaImageProcessorPil if pad else CLIPImageProcessorPil
        image_processor = kind(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                               **({"do_pad": True} if pad else {}))
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


def idefics3(directory: Path, *, smolvlm: bool = False, splitting: bool = True, seed: int = 0) -> Path:
    """A tiny ``Idefics3ForConditionalGeneration`` (or SmolVLM's): 32 px tiles of 8 px patches, 4 tokens a tile."""
    tokens = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
              *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
    tokenizer = tiny_tokenizer(*tokens)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    kind = "SmolVLM" if smolvlm else "Idefics3"
    vision = getattr(transformers, f"{kind}VisionConfig")(**VISION_SIZES, image_size=32, patch_size=8)
    text = transformers.LlamaConfig(**{**TEXT_SIZES, "vocab_size": 352}, bos_token_id=0, eos_token_id=2)
    config = getattr(transformers, f"{kind}Config")(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                                    scale_factor=2, image_token_id=image_token_id)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    redraw(model, seed)
    module = getattr(transformers.models, kind.lower())
    image_processor = getattr(getattr(module, f"image_processing_pil_{kind.lower()}"), f"{kind}ImageProcessorPil")(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=splitting)
    extra = {}
    with video_processor_class():
        if smolvlm:
            from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

            extra["video_processor"] = SmolVLMVideoProcessor()
        processor = getattr(transformers, f"{kind}Processor")(
            image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=SMOLVLM_TEMPLATE,
            **extra)
        return save(model, processor, directory, "v5")


@contextlib.contextmanager
def video_processor_class():
    """transformers hides ``VideoProcessorMixin`` without torchvision, yet SmolVLM's processor type-checks its
    (unused here) video processor against it: name it while a processor is built or loaded."""
    from transformers import processing_utils
    from transformers.video_processing_utils import VideoProcessorMixin

    module = processing_utils.transformers_module
    had = "VideoProcessorMixin" in vars(module)
    setattr(module, "VideoProcessorMixin", VideoProcessorMixin)
    try:
        yield
    finally:
        if not had:
            delattr(module, "VideoProcessorMixin")


def qwen2_audio(directory: Path, *, seed: int = 0) -> Path:
    """A tiny ``Qwen2AudioForConditionalGeneration`` with a 1 s feature chunk (100 mel frames, 50 positions)."""
    tokenizer = tiny_tokenizer("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", role="audio_token")
    audio = transformers.Qwen2AudioEncoderConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4,
                                                 encoder_ffn_dim=64, num_mel_bins=80, max_source_positions=50)
    text = transformers.Qwen2Config(**TEXT_SIZES, bos_token_id=0, eos_token_id=2)
    config = transformers.Qwen2AudioConfig(audio_config=audio, text_config=text,
                                           audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    model = transformers.Qwen2AudioForConditionalGeneration(config).eval()
    redraw(model, seed)
    features = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=1)
    processor = transformers.Qwen2AudioProcessor(feature_extractor=features, tokenizer=tokenizer)  # its template
    return save(model, processor, directory, "v5")


def reference(directory: Path, cls: type) -> tuple[transformers.PreTrainedModel, transformers.ProcessorMixin]:
    """The checkpoint loaded back by transformers (strictly: a missing or unexpected weight fails)."""
    model, info = cls.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if cls is not transformers.SmolVLMForConditionalGeneration:
        return model.eval(), transformers.AutoProcessor.from_pretrained(directory)
    # its video processor needs torchvision to load: the processor is rebuilt from its saved parts
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    settings = json.loads((directory / "processor_config.json").read_text())
    with video_processor_class():
        processor = transformers.SmolVLMProcessor(
            image_processor=transformers.AutoImageProcessor.from_pretrained(directory),
            tokenizer=transformers.AutoTokenizer.from_pretrained(directory), video_processor=SmolVLMVideoProcessor(),
            image_seq_len=settings["image_seq_len"], chat_template=(directory / "chat_template.jinja").read_text())
    return model.eval(), processor


#: Qwen/Qwen3-ASR-*-hf's template, as transformers' conversion script writes it: the system messages' text
#: (context), one audio placeholder per clip, assistant turns verbatim (the forced-language prefill)
QWEN3_ASR_TEMPLATE = (
    "{%- set ns = namespace(system_text='') -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- if m.content is string -%}"
    "{%- set ns.system_text = ns.system_text + m.content -%}{%- else -%}{%- for c in m.content -%}"
    "{%- if c.type == 'text' and (c.text is defined) -%}{%- set ns.system_text = ns.system_text + c.text -%}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endif -%}{%- endfor -%}"
    "{%- set ns2 = namespace(audio_tokens='') -%}"
    "{%- for m in messages -%}{%- if m.content is not string -%}{%- for c in m.content -%}"
    "{%- if c.type == 'audio' or ('audio' in c) or ('audio_url' in c) -%}"
    "{%- set ns2.audio_tokens = ns2.audio_tokens + '<|audio_start|><|audio_pad|><|audio_end|>' -%}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{{- '<|im_start|>system\n' + ns.system_text + '<|im_end|>\n' -}}"
    "{{- '<|im_start|>user\n' + ns2.audio_tokens + '<|im_end|>\n' -}}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{%- set ns3 = namespace(assistant_text='') -%}"
    "{%- if m.content is string -%}{%- set ns3.assistant_text = m.content -%}{%- else -%}"
    "{%- for c in m.content -%}{%- if c.type == 'text' and (c.text is defined) -%}"
    "{%- set ns3.assistant_text = ns3.assistant_text + c.text -%}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\n' -}}{% generation %}{{- ns3.assistant_text + '<|im_end|>\n' -}}{% endgeneration %}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def qwen3_asr(directory: Path, *, seed: int = 0) -> Path:
    """A tiny ``Qwen3ASRForConditionalGeneration`` (1 s encoder chunks, 2 s attention windows, a Qwen3 decoder)
    and its ``Qwen3ASRProcessor`` (``Qwen3ASRFeatureExtractor``, the published template); ``<asr_text>`` is an
    added token that is not special, as in the published tokenizer (decoding keeps it)."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_qwen3_asr_tokens(), bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[0], extra_special_tokens={
            "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"})
    audio = transformers.Qwen3ASREncoderConfig(
        num_mel_bins=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
        output_dim=64, downsample_hidden_size=8, n_window=50, n_window_infer=200)
    text = transformers.Qwen3Config(**{**TEXT_SIZES, "vocab_size": 320}, head_dim=16, bos_token_id=0,
                                    eos_token_id=2, tie_word_embeddings=True)
    config = transformers.Qwen3ASRConfig(audio_config=audio, text_config=text,
                                         audio_token_id=tokenizer.convert_tokens_to_ids("<|audio_pad|>"),
                                         pad_token_id=0, eos_token_id=[0, 2])
    model = transformers.Qwen3ASRForConditionalGeneration(config).eval()
    redraw(model, seed)
    features = transformers.Qwen3ASRFeatureExtractor(feature_size=32)
    processor = transformers.Qwen3ASRProcessor(feature_extractor=features, tokenizer=tokenizer,
                                               chat_template=QWEN3_ASR_TEMPLATE)
    return save(model, processor, directory, "v5")


def _qwen3_asr_tokens():
    tok = train_tiny_tokenizer(300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>")])
    tok.add_tokens([AddedToken("<asr_text>", special=False, normalized=False)])
    return tok
