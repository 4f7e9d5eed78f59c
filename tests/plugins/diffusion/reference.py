"""A tiny random DiffusionGemma built by transformers' own classes and saved with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.models.text import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tiny_tokenizer

VOCAB = 300
CANVAS = 8
#: sliding window 6: a prompt longer than 5 tokens is cut off from the sliding layers' view
TEXT_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    num_experts=4, top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=512,
    pad_token_id=0, bos_token_id=0, eos_token_id=2,
)
VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
#: the near-zero temperature schedule of the comparisons (the reference has no greedy mode)
NEAR_ZERO = dict(t_min=0.0, t_max=1e-6)


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(VOCAB), bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[0], chat_template=CHATML_TEMPLATE)


def build(path: Path, seed: int = 0) -> transformers.DiffusionGemmaForBlockDiffusion:
    """Save a random model and its tokenizer into ``path``; return the model (eval mode, float32)."""
    config = transformers.DiffusionGemmaConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG,
                                               canvas_length=CANVAS)
    torch.manual_seed(seed)
    model = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        # initialized norms are all ones and scalars 1: perturb them so that each one is exercised,
        # and widen the embedding so the logits are far from uniform
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                param.add_(torch.randn_like(param) * 0.2)
        model.model.decoder.embed_tokens.weight.mul_(20.0)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.fill_(0.8 if ".encoder." in name else 1.1)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return model


def generate(model, prompt_ids: list[int], seed: int, max_new_tokens: int, eos_token_id: int | None = None,
             **settings) -> list[int]:
    """The reference's answer: ``torch.manual_seed(seed); model.generate(...)``, cut after its first end token."""
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                         pad_token_id=0 if eos_token_id is not None else None, **settings)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[:tokens.index(eos_token_id) + 1]
    return tokens[:max_new_tokens]
