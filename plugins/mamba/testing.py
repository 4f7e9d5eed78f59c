"""Test helper: a tiny random-weight Nemotron-H checkpoint in the Hugging Face layout.

Plugin tests write one with ``save_tiny_hybrid_checkpoint`` into a temp dir and
load it through the real loader. The tokenizer is the text plugin's tiny BPE.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ifb_plugins.common.testing import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tiny_tokenizer


def tiny_hybrid_config(pattern: str = "M-M*-M-", *, vocab_size: int = 320, hidden_size: int = 64,
                       tie_word_embeddings: bool = False) -> dict[str, Any]:
    """A Nemotron-H ``config.json`` with tiny shapes (two groups, GQA attention, short conv)."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern),
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "mlp_hidden_act": "relu2",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "mamba_num_heads": 8,
        "mamba_head_dim": hidden_size // 8,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "expand": 1,
        "chunk_size": 8,
        "use_conv_bias": True,
        "use_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "mamba_hidden_act": "silu",
        "layer_norm_epsilon": 1e-5,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, head_dim = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    inner = heads * head_dim
    conv_dim = inner + 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    q_size, kv_size = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        # Fan-in scaling keeps activations O(1) through the layers, so logits are meaningful.
        std = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=gen) * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + rand(dim, scale=0.1)  # not all ones, so a dropped norm weight shows

    sd = {"backbone.embeddings.weight": rand(vocab, h, scale=1.0), "backbone.norm_f.weight": norm(h)}
    for i, kind in enumerate(cfg["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        sd[p + "norm.weight"] = norm(h)
        m = p + "mixer."
        if kind == "M":
            in_proj = rand(inner + conv_dim + heads, h)
            in_proj[-heads:] *= 0.5  # keep softplus(dt + dt_bias) well inside (1e-3, 1): a live, stable state
            sd[m + "in_proj.weight"] = in_proj
            sd[m + "conv1d.weight"] = rand(conv_dim, 1, cfg["conv_kernel"])
            sd[m + "conv1d.bias"] = rand(conv_dim, scale=0.1)
            # A in [1, 16]: some heads remember for tens of tokens, others forget at once.
            sd[m + "A_log"] = torch.log(1.0 + 15.0 * torch.rand(heads, generator=gen))
            sd[m + "D"] = 1.0 + rand(heads, scale=0.1)
            dt = torch.exp(torch.rand(heads, generator=gen) * (math.log(0.5) - math.log(0.05)) + math.log(0.05))
            sd[m + "dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
            sd[m + "norm.weight"] = norm(inner)
            sd[m + "out_proj.weight"] = rand(h, inner)
        elif kind == "*":
            sd[m + "q_proj.weight"] = rand(q_size, h)
            sd[m + "k_proj.weight"] = rand(kv_size, h)
            sd[m + "v_proj.weight"] = rand(kv_size, h)
            sd[m + "o_proj.weight"] = rand(h, q_size)
        else:
            sd[m + "up_proj.weight"] = rand(cfg["intermediate_size"], h)
            sd[m + "down_proj.weight"] = rand(h, cfg["intermediate_size"])
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = rand(vocab, h)
    return sd


def save_tiny_hybrid_checkpoint(directory: str | Path, seed: int = 0, *, pattern: str = "M-M*-M-",
                                vocab_size: int = 320, hidden_size: int = 64,
                                tie_word_embeddings: bool = False) -> Path:
    """Write a tiny random-weight Nemotron-H checkpoint (config, safetensors, tokenizer); returns the dir."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hybrid_config(pattern, vocab_size=vocab_size, hidden_size=hidden_size,
                             tie_word_embeddings=tie_word_embeddings)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = _random_weights(cfg, seed)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    tok = train_tiny_tokenizer(vocab_size=min(300, vocab_size))
    tok.save(str(directory / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": 512,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return directory
