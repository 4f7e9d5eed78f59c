"""A tiny random Qwen3-Omni, built and saved by transformers' own classes (the reference for the speech tests)."""

from __future__ import annotations

from pathlib import Path

import torch

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "interleaved": True}
SPEAKERS = {"ethan": 1040, "chelsie": 1041}
#: codes 0..31; the talker's vocabulary is 1024 ids larger (the reference never picks its top 1024 but EOS)
TALKER_VOCAB = 32 + 1024


OMNI_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>", "<|audio_pad|>",
                "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|vision_start|>", "<|vision_end|>",
                "<|audio_end|>"]
#: the tokens Qwen3-Omni's processor finds by role on its tokenizer
TOKEN_ROLES = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
               "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
               "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
#: Qwen3-Omni's template, cut down: a string content, or text / audio / image parts (one placeholder each)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for p in m['content'] %}"
                 "{% if p['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
                 "{% elif p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                 "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def omni_tokenizer():
    """A byte-level BPE of 288 tokens and the Thinker's special tokens after them (ids 288 ..)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=288, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["system", "user", "assistant"] * 8 + ["Say hi.", "Hello there, how are you?"], trainer)
    bpe.add_special_tokens([AddedToken(t, special=True) for t in OMNI_SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE,
                                   extra_special_tokens=dict(TOKEN_ROLES))


def tiny_omni_config(tokenizer):
    from transformers import Qwen3OmniMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in OMNI_SPECIAL}
    word = {w: tokenizer.convert_tokens_to_ids(w) for w in ("system", "user", "assistant")}

    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                rope_parameters=dict(ROPE))
    talker_text = dict(vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
                       rope_parameters=dict(ROPE))
    return Qwen3OmniMoeConfig(
        thinker_config=dict(
            text_config=text,
            audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                              d_model=16, output_dim=32, downsample_hidden_size=8, n_window=50, n_window_infer=200),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                               out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            audio_end_token_id=ids["<|audio_end|>"]),
        talker_config=dict(
            text_config=talker_text,
            code_predictor_config=dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4),
            num_code_groups=4, thinker_hidden_size=32, accept_hidden_layer=1, codec_eos_token_id=1030,
            codec_nothink_id=1031, codec_think_bos_id=1032, codec_think_eos_id=1033, codec_pad_id=1034,
            codec_bos_id=1035,
            speaker_id=dict(SPEAKERS), spatial_merge_size=2),
        # a window of 4 frames, shorter than the test's code sequences, so the window is exercised
        code2wav_config=dict(codebook_size=32, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=64, num_hidden_layers=2, num_quantizers=4, sliding_window=4,
                             upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=16),
        tts_pad_token_id=ids["<|tts_pad|>"], tts_bos_token_id=ids["<|tts_bos|>"], tts_eos_token_id=ids["<|tts_eos|>"],
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"], system_token_id=word["system"],
        user_token_id=word["user"], assistant_token_id=word["assistant"])


def feature_extractor():
    """The processor's Whisper feature extractor, at the tiny audio encoder's 16 mel bins."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, n_fft=400)


def image_processor():
    """The processor's Qwen2-VL image processor, cutting the tiny vision encoder's 4-pixel patches."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32})


def liven(module: torch.nn.Module, seed: int) -> None:
    """Give the near-identity parameters (layer scales, SnakeBeta, ConvNeXt gamma) random values.

    At their initial values (0.01, 0, 1e-6) the transformer and ConvNeXt blocks
    would barely touch the waveform, and a comparison could not see a fault there.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("scale", "gamma", "alpha", "beta"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif leaf == "cluster_usage":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif leaf == "embedding_sum" or (leaf == "weight" and p.dim() >= 2):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p[0].numel() ** 0.5)


def save_tiny_omni(path: Path, seed: int = 0):
    """Build ``Qwen3OmniMoeForConditionalGeneration`` with random weights and ``save_pretrained`` it."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tokenizer = omni_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_omni_config(tokenizer)).eval()
    with torch.no_grad():  # transformers 5.24 leaves the stacked MoE experts as torch.empty: give them values
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    liven(model.code2wav, seed)
    liven(model.thinker, seed)  # at the 0.02-std init an audio clip barely reaches the Thinker's logits
    with torch.no_grad():  # the Talker's init is near-uniform: spread it so greedy picks depend on every weight
        gen = torch.Generator().manual_seed(seed)
        for p in model.talker.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(path)
    processor(tokenizer).save_pretrained(path)  # transformers 5: one processor_config.json, settings nested
    return model


def processor(tokenizer):
    """``Qwen3OmniMoeProcessor`` over the tiny image processor, feature extractor and tokenizer.

    Its video processor (Qwen2-VL's) needs torchvision, which the suite does not install, and ifb
    takes no video: SmolVLM's video processor, which needs none, stands in its place.
    """
    from transformers import Qwen3OmniMoeProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    from tests.plugins.vlm.tiny import video_processor_class

    with video_processor_class():
        return Qwen3OmniMoeProcessor(image_processor=image_processor(), video_processor=SmolVLMVideoProcessor(),
                                     feature_extractor=feature_extractor(), tokenizer=tokenizer,
                                     chat_template=CHAT_TEMPLATE)
