"""Test helpers: a tiny random Gemma 4 text model built with transformers' ``Gemma4ForCausalLM`` and
saved with ``save_pretrained``, with every text feature on: sliding-window and full layers of
different head widths and KV heads, KV sharing, per-layer inputs, keys as values on the full
layers, double-wide shared-layer MLPs, final logit soft-capping."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.models.text import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tiny_tokenizer

VOCAB_SIZE = 320
SLIDING_WINDOW = 16
LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention")


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Fan-in scaled matrices, norms and layer scalars near one: transformers' init leaves
    near-zero logits, which would make a comparison prove little."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("layer_scalar"):
            p.copy_(0.75 + 0.5 * torch.rand(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 2:  # the embeddings too: scaled by sqrt(hidden) on input, tied as the output head
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def save_tiny_gemma4(directory: str | Path, seed: int = 0, **overrides) -> Path:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, sliding_window=SLIDING_WINDOW,
        vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
        final_logit_softcapping=30.0, attention_k_eq_v=True, use_double_wide_mlp=True,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**fields, **overrides})).float().eval()
    _redraw(model, seed)
    directory = Path(directory)
    model.save_pretrained(str(directory))
    tok = train_tiny_tokenizer(vocab_size=300)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": 2048}, indent=2))
    return directory
