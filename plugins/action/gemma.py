"""The Gemma stack pi0 runs twice: PaliGemma's language model over the prefix, the action expert over
the state and noisy actions attending to the prefix's KV.

A batch is padded: ``x [B, S, H]`` with per-request positions; ``mask [B, S, K]`` (True: may attend)
says which of the ``K`` keys (the given past KV, then the ``S`` new ones) each query sees. Gemma's
norms scale by ``1 + weight``; the loader folds the 1 into the weight, so the shared ``RMSNorm`` runs
them. Shape letters: B requests, S new tokens, K keys, H hidden, Hq / Hkv heads, D head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.models.decoder import RMSNorm, apply_rope, rope_inv_freq
from ifb_plugins.common.media.vision import activation
from ifb_plugins.action.config import GemmaConfig

KV = tuple[torch.Tensor, torch.Tensor]  # [B, K, Hkv, D] each


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        """The output ``[B, S, H]`` and this call's own (rotated) K and V ``[B, S, Hkv, D]``."""
        b, s, _ = x.shape
        c = self.cfg
        q = apply_rope(self.q_proj(x).view(b * s, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b * s, c.num_kv_heads, c.head_dim), cos, sin)
        q, k = q.view(b, s, c.num_heads, c.head_dim), k.view(b, s, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim)
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), 1), torch.cat((past[1], v), 1))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None],
            enable_gqa=c.num_heads != c.num_kv_heads)  # [B, Hq, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), (k, v)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class GemmaLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GemmaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GemmaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class GemmaStack(nn.Module):
    """Layers and final norm (and, for the language model, the token embedding scaled by sqrt(H))."""

    def __init__(self, cfg: GemmaConfig, *, has_embedding: bool) -> None:
        super().__init__()
        self.cfg = cfg
        if has_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # Gemma scales its token embeddings (not embeddings given to it) by sqrt(H), in the weights' dtype
        return self.embed_tokens(ids) * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=self.embed_tokens.weight.dtype)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` ``[B * S, D]`` at ``positions [B, S]`` (float32 angles, as Gemma's rotary)."""
        freqs = positions.reshape(-1, 1).float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                past: list[KV] | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Normed hidden states ``[B, S, H]`` and each layer's new K/V; ``past``: each layer's earlier K/V."""
        cos, sin = self.rotary(positions, x.dtype)
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask, None if past is None else past[i])
            kvs.append(kv)
        return self.norm(x), kvs
