"""Test helpers: tiny random hybrid models built with transformers' own classes and saved with ``save_pretrained``.

The weights are redrawn after construction (transformers' initialisation
leaves logits near zero and the SSM nearly memoryless, which would make a
comparison prove little): fan-in scaled matrices, norms near one, and
``A``/``dt`` ranges that keep some heads remembering for tens of tokens. The
layout on disk is whatever transformers writes. The tokenizer is the shared
layer's tiny BPE.
"""

from __future__ import annotations

import math
from pathlib import Path
import torch

from tests.models.text import save_tiny_tokenizer

VOCAB_SIZE = 320
HIDDEN_SIZE = 64


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int, mamba_heads: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def randn(shape, scale: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=gen)))
        elif leaf == "dt_bias":
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.5) - math.log(0.05)) + math.log(0.05))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        elif p.dim() == 1 and "layernorm" in name or name.endswith(("q_norm.weight", "k_norm.weight",
                                                                    "model.norm.weight")):
            # Qwen3.5's zero-centered norms scale by 1 + weight; elsewhere these are plain norms near one
            zero_centered = "linear_attn" not in name and "qwen3_5" in type(model).__name__.lower()
            p.copy_((0.0 if zero_centered else 1.0) + randn(p.shape, 0.1))
        elif leaf == "D" or p.dim() == 1 and "norm" in name:
            p.copy_(1.0 + randn(p.shape, 0.1))
        elif p.dim() == 1:  # biases
            p.copy_(randn(p.shape, 0.1))
        elif "embed" in name:
            p.copy_(randn(p.shape, 1.0))
        else:
            p.copy_(randn(p.shape, 1.0 / math.sqrt(p.shape[-1])))
            if name.endswith("in_proj.weight") and mamba_heads:
                p[-mamba_heads:] *= 0.5  # keep softplus(dt + dt_bias) well inside (1e-3, 1): a live, stable state
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # Nemotron-H's MoE router: biased choice, unbiased weights
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)


def _save(model, directory: str | Path, seed: int, mamba_heads: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _redraw(model, seed, mamba_heads)
    model.save_pretrained(str(directory))
    save_tiny_tokenizer(directory, min(300, VOCAB_SIZE))
    return directory


def save_tiny_nemotron_h(directory: str | Path, seed: int = 0, *, pattern: str = "M-M*-M-",
                         tie_word_embeddings: bool = False, **overrides) -> Path:
    """A tiny ``NemotronHForCausalLM`` (two SSM groups, GQA attention, short conv), saved by transformers.

    ``overrides`` are further ``NemotronHConfig`` fields (a benchmark's larger shapes)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, hybrid_override_pattern=pattern,
        intermediate_size=2 * HIDDEN_SIZE, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        max_position_embeddings=2048, tie_word_embeddings=tie_word_embeddings, bos_token_id=0, eos_token_id=2,
        pad_token_id=0)
    config = NemotronHConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    return _save(NemotronHForCausalLM(config).float().eval(), directory, seed, config.mamba_num_heads)


def save_tiny_nemotron_3(directory: str | Path, seed: int = 0, *, pattern: str = "ME*EM-E",
                         moe_latent_size: int | None = None) -> Path:
    """A tiny Nemotron 3 (``NemotronHForCausalLM`` with ``E`` mixture-of-experts layers): 8 routed experts in
    4 groups, 2 groups and 2 experts per token, scaled weights, a shared expert; optionally a latent."""
    path = save_tiny_nemotron_h(
        directory, seed, pattern=pattern, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, moe_latent_size=moe_latent_size)
    return path


def save_tiny_bamba(directory: str | Path, seed: int = 0, *, num_layers: int = 3,
                    attn_layer_indices: tuple[int, ...] = (1,)) -> Path:
    """A tiny ``BambaForCausalLM`` (Mamba-2 and RoPE attention layers, each followed by SwiGLU)."""
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_hidden_layers=num_layers,
        attn_layer_indices=list(attn_layer_indices), intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_expand=1,
        mamba_chunk_size=8, max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return _save(BambaForCausalLM(config).float().eval(), directory, seed, config.mamba_n_heads)


def save_tiny_granite_hybrid(directory: str | Path, seed: int = 0, *,
                             layer_types: tuple[str, ...] = ("mamba", "attention", "mamba"),
                             num_local_experts: int = 4, position_embedding_type: str | None = "rope",
                             tie_word_embeddings: bool = False) -> Path:
    """A tiny ``GraniteMoeHybridForCausalLM`` with Granite's multipliers, a shared MLP and routed experts."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        shared_intermediate_size=48, num_local_experts=num_local_experts, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_expand=1, mamba_chunk_size=8,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
        position_embedding_type=position_embedding_type, max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return _save(GraniteMoeHybridForCausalLM(config).float().eval(), directory, seed, config.mamba_n_heads)


def save_tiny_qwen3_5(directory: str | Path, seed: int = 0, *, moe: bool = False,
                      layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "full_attention",
                                                      "linear_attention")) -> Path:
    """A tiny ``Qwen3_5ForCausalLM`` (or ``Qwen3_5MoeForCausalLM``): Gated DeltaNet layers with 2 key and 4
    value heads beside gated attention with partial RoPE."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_hidden_layers=len(layer_types),
        layer_types=list(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if moe:
        config = Qwen3_5MoeTextConfig(**fields, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=40)
        model = Qwen3_5MoeForCausalLM(config)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields, intermediate_size=96))
    torch.manual_seed(seed)
    return _save(model.float().eval(), directory, seed, mamba_heads=0)


#: family name -> the saver of its tiny reference model
SAVERS = {"nemotron_h": save_tiny_nemotron_h, "bamba": save_tiny_bamba, "granitemoehybrid": save_tiny_granite_hybrid}


def hf_reference(path: str | Path):
    """The transformers model a tiny checkpoint was saved from, loaded back in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' own ``generate``, greedy, for exactly ``num_tokens`` tokens: no end-of-sequence token
    stops it or is masked (the engine's ``ignore_eos``)."""
    import copy

    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None  # a None passed to generate falls back to the model's
    try:
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=num_tokens, min_new_tokens=0,
                             pad_token_id=0)
    finally:
        model.generation_config = saved
    assert out.shape[1] == len(ids) + num_tokens
    return out[0, len(ids):].tolist()
