"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) over a paged KV cache.

One ``forward`` runs one engine step: a ragged batch of prefill chunks and
decode tokens packed along a flat token axis ``T``. Parameter names follow the
Hugging Face layout (``model.layers.N.self_attn.q_proj.weight``, ...), so a
checkpoint's state dict loads as is.

Shape letters: T tokens in the step, H hidden size, Hq / Hkv query / KV heads,
D head dim, I intermediate size, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.text import triton_kernels
from ifb_plugins.text.attention import AttnMetadata, paged_attention, write_kv
from ifb_plugins.text.config import TextModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def allocate_kv_cache(
    config: TextModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    """One ``(k_cache, v_cache)`` pair per layer, each ``[num_blocks, block_size, Hkv, D]``.

    Zero-filled rather than empty: padded slots are masked out of attention,
    but a NaN left in one would still poison the softmax (NaN * 0 == NaN).
    """
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]


def rope_inv_freq(config: TextModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` for the config's theta and scaling (float32)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        # Stretching positions by 1/factor is the same as dividing every frequency.
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        # llama.cpp stores llama3-style scaling as per-frequency divisors (rope_freqs.weight).
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise NotImplementedError(f"RoPE scaling {kind!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by ``cos/sin [T, D]`` (rotate-half pairing: i with i + D/2)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, with a learned per-channel scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_kernels.applies_to(x):  # CUDA inference: one fused kernel, same rounding
            return triton_kernels.rms_norm(x, self.weight, self.eps)
        # Normalize in float32 whatever the model dtype, as the reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention with RoPE (and Qwen3's per-head q/k norm) over the paged cache."""

    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.q_proj = nn.Linear(h, config.q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        q = self.q_proj(x).view(t, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, attn)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, c.q_size))  # [T, H]


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, I] -> [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TextModel(nn.Module):
    """A Llama-family causal LM whose forward is one paged, ragged engine step."""

    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Not persistent: it is derived from the config, never read from a checkpoint.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32 or inv_freq.is_meta:
            # A whole-model cast (model.to(torch.bfloat16)) must not round the frequencies.
            inv_freq = self.inv_freq = rope_inv_freq(self.config).to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnMetadata,
        kv_caches: list[KVCache],
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step over ``input_ids [T]`` at ``positions [T]``; returns normed hidden states ``[T, H]``.

        Writes the step's K/V into ``kv_caches`` (one pair per layer) at ``attn.slot_mapping``.
        ``input_embeds [T, H]``, when given, replaces the token embeddings (media splicing).
        """
        x = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, H]
        cos, sin = self._rope(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attn, kv_cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[N, H]`` to float32 logits ``[N, V]``."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()
