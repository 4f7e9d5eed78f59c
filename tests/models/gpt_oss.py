"""Test helpers: a tiny random gpt-oss built with transformers' ``GptOssForCausalLM`` and saved with
``save_pretrained``: alternating sliding-window (16 tokens) and full layers with sinks, 8 experts
(2 per token), YaRN RoPE as the released checkpoints configure it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.models.text import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tiny_tokenizer

VOCAB_SIZE = 320
SLIDING_WINDOW = 16


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("bias", "_bias")):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:  # [E, in, out]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def save_tiny_gpt_oss(directory: str | Path, seed: int = 0, chat_template: str = CHATML_TEMPLATE,
                      **overrides) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW, max_position_embeddings=4096, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**fields, **overrides})).float().eval()
    _redraw(model, seed)
    directory = Path(directory)
    model.save_pretrained(str(directory))
    tok = train_tiny_tokenizer(vocab_size=300)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template,
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": 4096}, indent=2))
    return directory
