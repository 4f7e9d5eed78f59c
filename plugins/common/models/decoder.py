"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM; with ``moe.SparseMoE`` layers Mixtral,
Qwen2-MoE, Qwen3-MoE) over a paged KV cache.

One ``forward`` runs one engine step: a ragged batch of prefill chunks and
decode tokens packed along a flat token axis ``T``. Parameter names follow the
Hugging Face layout (``model.layers.N.self_attn.q_proj.weight``, ...), so a
checkpoint's state dict loads as is.

Shape letters: T tokens in the step, H hidden size, Hq / Hkv query / KV heads,
D head dim, I intermediate size, V vocab.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.layers import triton_kernels
from ifb_plugins.common.layers.attention import AttnMetadata, write_kv
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.layers.moe import SparseMoE
from ifb_plugins.common.layers.mrope import section_rows, select_sections
from ifb_plugins.common.models.parts import KVCache, LayerStack, ModelParts


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


def rope_inv_freq(config: TextModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies ``[D/2]`` for the config's theta and scaling (float32)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        # Stretching positions by 1/factor is the same as dividing every frequency.
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        # llama.cpp stores llama3-style scaling as per-frequency divisors (rope_freqs.weight).
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device=inv_freq.device)
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


def _apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` with the rotation's sign folded into ``signed_sin [T, 1, D]`` (``-sin | sin``).

    ``cat(-x2, x1) * sin == swap_halves(x) * signed_sin`` elementwise, so this is
    the same arithmetic in three ops instead of six.
    """
    t, heads, d = x.shape
    swapped = x.reshape(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    return x * cos + swapped * signed_sin


def rope_table(config: TextModelConfig, inv_freq: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, 2, D]`` float32: ``cos`` and signed ``sin`` (``-sin | sin``) of positions ``0..length-1``."""
    positions = torch.arange(length, dtype=torch.int64, device=inv_freq.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
    sin = emb.sin()
    half = config.head_dim // 2
    sin[:, :half].neg_()
    return torch.stack((emb.cos(), sin), dim=1)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, with a learned per-channel scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_kernels.applies_to(x):  # CUDA inference: one fused kernel, same rounding
            return triton_kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call, bit-identical to the composite below for float32 (and cheaper per step).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalize in float32 whatever the model dtype, as the reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention with RoPE (and Qwen3's per-head q/k norm) over the paged cache.

    ``parts`` (``models.parts``) picks the projections, Q/K/V fused into one
    matmul (``qkv_proj``) where it can, and the attention kernel (``attention_impl``).
    """

    def __init__(self, config: TextModelConfig, parts: ModelParts | None = None, prefix: str = "self_attn") -> None:
        super().__init__()
        parts = parts or ModelParts()
        self.config = config
        h, bias = config.hidden_size, config.attention_bias
        sizes = (("q_proj", config.q_size), ("k_proj", config.kv_size), ("v_proj", config.kv_size))
        #: q, k and v as one matmul (rows q | k | v), or None: ``q_proj``, ``k_proj`` and ``v_proj``
        self.qkv_proj = parts.fused(f"{prefix}.qkv_proj", [(f"{prefix}.{p}", n) for p, n in sizes], h, bias)
        if self.qkv_proj is None:
            for p, n in sizes:
                setattr(self, p, parts.linear(f"{prefix}.{p}", h, n, bias))
        self.o_proj = parts.linear(f"{prefix}.o_proj", config.q_size, h, config.attention_out_bias)
        #: completes ``o_proj``'s output where it is one rank's partial sum (``parts.partial_sum``), else None
        self.o_sum = parts.partial_sum(f"{prefix}.o_proj")
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        #: the paged attention kernel (``attention.paged_attention``'s signature)
        self.attention_impl: Callable[..., torch.Tensor] = parts.attention(prefix)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """``cos`` and ``sin`` are ``[T, 1, D]``, ``sin`` signed (``-sin | sin``, see ``rope_table``)."""
        c = self.config
        t = x.shape[0]
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
            v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
            if c.qk_norm:
                q = self.q_norm(qkv[:, : hq * d].view(t, hq, d))
                k = self.k_norm(qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d))
                q, k = _apply_rope_signed(q, cos, sin), _apply_rope_signed(k, cos, sin)
            else:
                # q and k heads side by side: one rotation for both
                qk = _apply_rope_signed(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]
        else:
            q = self.q_proj(x).view(t, hq, d)  # [T, Hq, D]
            k = self.k_proj(x).view(t, hkv, d)  # [T, Hkv, D]
            v = self.v_proj(x).view(t, hkv, d)  # [T, Hkv, D]
            if c.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = _apply_rope_signed(q, cos, sin), _apply_rope_signed(k, cos, sin)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        out = self.attention_impl(q, k_cache, v_cache, attn)  # [T, Hq, D]
        y = self.o_proj(out.reshape(t, c.q_size))  # [T, H]
        return y if self.o_sum is None else self.o_sum(y)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; gate and up fused into one matmul
    (``gate_up_proj``) where ``parts`` can."""

    def __init__(self, config: TextModelConfig, parts: ModelParts | None = None, prefix: str = "mlp") -> None:
        super().__init__()
        parts = parts or ModelParts()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        #: gate and up as one matmul (rows gate | up), or None: ``gate_proj`` and ``up_proj``
        self.gate_up_proj = parts.fused(f"{prefix}.gate_up_proj", [(f"{prefix}.gate_proj", i), (f"{prefix}.up_proj", i)],
                                        h, bias)
        if self.gate_up_proj is None:
            self.gate_proj = parts.linear(f"{prefix}.gate_proj", h, i, bias)
            self.up_proj = parts.linear(f"{prefix}.up_proj", h, i, bias)
        self.down_proj = parts.linear(f"{prefix}.down_proj", i, h, bias)
        #: completes ``down_proj``'s output where it is one rank's partial sum (``parts.partial_sum``), else None
        self.down_sum = parts.partial_sum(f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
            y = self.down_proj(F.silu(gate) * up)
        else:
            y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, I] -> [T, H]
        return y if self.down_sum is None else self.down_sum(y)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP (a ``SparseMoE`` where the config makes layer ``layer_idx`` sparse)."""

    def __init__(self, config: TextModelConfig, layer_idx: int = 0, parts: ModelParts | None = None) -> None:
        super().__init__()
        parts = parts or ModelParts()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = Attention(config, parts, f"{prefix}.self_attn")
        self.mlp = (SparseMoE(config, parts, f"{prefix}.mlp") if config.is_sparse_layer(layer_idx)
                    else MLP(config, parts, f"{prefix}.mlp"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The ``model.`` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, config: TextModelConfig, parts: ModelParts | None = None) -> None:
        super().__init__()
        parts = parts or ModelParts()
        self.embed_tokens = parts.embedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i, parts) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TextModel(nn.Module):
    """A Llama-family causal LM whose forward is one paged, ragged engine step."""

    def __init__(self, config: TextModelConfig, parts: ModelParts | None = None) -> None:
        """Build the model from ``parts`` (``models.parts``; by default the float32 torch modules)."""
        super().__init__()
        parts = parts or ModelParts()
        self.config = config
        self.model = Decoder(config, parts)
        lm_head = parts.lm_head(config)
        if lm_head is not None:
            self.lm_head = lm_head
        #: the output head when it is not the float32 matmul (GGUF blocks, torch's int4), else None
        self.head: nn.Module | None = parts.head(config, self.model.embed_tokens, lm_head)
        #: what runs the layers each step, ``(x, cos, sin, attn, kv_caches) -> x`` (``models.parts.LayerStack``)
        self.layer_stack: LayerStack = parts.layer_stack(self.model.layers, config)
        # Not persistent: it is derived from the config, never read from a checkpoint; on the host
        # even while the model is built on the meta device (``rotary`` re-derives it after a cast).
        self.register_buffer("inv_freq", rope_inv_freq(config, device="cpu"), persistent=False)
        # cos / signed sin per position, grown on demand; rebuilt if inv_freq is replaced
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # M-RoPE: the position row (0-2) of each rotary column, for ``positions [3, T]``
        self._mrope_rows = (section_rows(config.mrope_section, config.head_dim, config.mrope_interleaved)
                            if config.mrope_section else None)
    def rotary(self, positions: torch.Tensor, dtype: torch.dtype,
               num_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` ``[T, 1, D]`` at ``positions [T]`` (or ``[3, T]``, M-RoPE), all below ``num_positions``."""
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32 or inv_freq.is_meta:
            # A whole-model cast (model.to(torch.bfloat16)) must not round the frequencies.
            inv_freq = self.inv_freq = rope_inv_freq(self.config).to(positions.device)
        if num_positions is None:
            num_positions = int(positions.max()) + 1 if positions.numel() else 1
        cache = self._rope_cache
        if cache is None or cache[0] is not inv_freq or cache[1].shape[0] < num_positions \
                or cache[1].device != positions.device:
            length = max(256, 1 << (num_positions - 1).bit_length())  # doubling: rebuilt O(log n) times
            cache = self._rope_cache = (inv_freq, rope_table(self.config, inv_freq, length))
        if positions.dim() == 2:  # M-RoPE ids: temporal / height / width rows
            cs = select_sections(cache[1], positions, self._mrope_rows)  # [T, 2, D]
        else:
            cs = cache[1].index_select(0, positions)  # [T, 2, D]
        if cs.dtype != dtype:
            cs = cs.to(dtype)
        return cs[:, 0:1], cs[:, 1:2]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnMetadata,
        kv_caches: list[KVCache],
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step over ``input_ids [T]`` at ``positions [T]``; returns normed hidden states ``[T, H]``.

        An M-RoPE model (``config.mrope_section``) takes ``positions [3, T]``.

        Writes the step's K/V into ``kv_caches`` (one pair per layer) at ``attn.slot_mapping``.
        ``input_embeds [T, H]``, when given, replaces the token embeddings (media splicing).
        """
        x = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, H]
        # M-RoPE ids of a pruned image may pass its context index: read their bound from the ids
        cos, sin = self.rotary(positions, x.dtype, max(attn.seq_lens_host) if positions.dim() == 1 else None)
        return self.model.norm(self.layer_stack(x, cos, sin, attn, kv_caches))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[N, H]`` to float32 logits ``[N, V]``."""
        if self.head is not None:
            return self.head(hidden)
        weight = self.lm_head.weight if hasattr(self, "lm_head") else self.model.embed_tokens.weight
        return F.linear(hidden, weight).float()

