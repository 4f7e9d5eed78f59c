"""One DiffusionGemma layer: Gemma-4-style attention and the dense MLP beside the routed experts.

The encoder and the denoiser share these weights (transformers ties them):
one layer serves both. Its rows come from several *segments* packed along a
flat token axis: finished tokens to encode (causal over the request's cached
prefix, their KV appended to it) and canvases to denoise (bidirectional over
the cached prefix and the whole canvas, nothing written). Attention runs per
segment; everything else runs on all rows at once.

Shape letters: N rows in the forward, T a segment's rows, H hidden size, Hq /
Hkv query / KV heads, D the layer's head dim, E experts, K experts per token,
I intermediate sizes.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ifb_plugins.common.models.decoder import RMSNorm, apply_rope
from ifb_plugins.common.layers.moe import route
from ifb_plugins.diffusion.cache import PrefixKV
from ifb_plugins.diffusion.config import DiffusionGemmaConfig, LayerSpec, RopeSpec


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last axis without a learned scale (the values', the router's, self-conditioning's)."""
    return F.rms_norm(x, (x.shape[-1],), None, eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """``[D/2]`` float32 inverse frequencies; proportional RoPE leaves the unrotated pairs at 0."""
    if spec.rope_type == "default":
        return 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    num_rotated = int(spec.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (spec.theta ** (torch.arange(0, 2 * num_rotated, 2, dtype=torch.int64).float() / head_dim))
    unrotated = torch.zeros(head_dim // 2 - num_rotated, dtype=torch.float32)
    return torch.cat((rotated, unrotated)) / spec.factor


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin [N, D]`` of ``positions [N]``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos(), emb.sin()


@attrs.frozen
class Segment:
    """One request's rows in a forward: ``rows`` of the flat axis, at ``start_pos`` onwards."""

    rows: slice
    start_pos: int
    cache: PrefixKV
    #: a canvas to denoise (reads the cache) rather than finished tokens to encode (appends to it)
    is_canvas: bool


class Attention(nn.Module):
    def __init__(self, config: DiffusionGemmaConfig, spec: LayerSpec) -> None:
        super().__init__()
        h, d = config.hidden_size, spec.head_dim
        self.spec = spec
        self.num_heads = config.num_heads
        self.window = config.sliding_window if spec.is_sliding else None
        self.eps = config.rms_norm_eps
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False) if spec.has_v_proj else None
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                segments: Sequence[Segment]) -> torch.Tensor:
        n, d = x.shape[0], self.spec.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(n, self.num_heads, d)), cos, sin)  # [N, Hq, D]
        k_raw = self.k_proj(x).view(n, self.spec.num_kv_heads, d)  # [N, Hkv, D]
        v = self.v_proj(x).view(n, self.spec.num_kv_heads, d) if self.v_proj is not None else k_raw
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = unit_rms_norm(v, self.eps)
        out = torch.empty_like(q)
        # finished tokens first: a canvas of the same request in this forward reads what they append
        for seg in sorted(segments, key=lambda s: s.is_canvas):
            out[seg.rows] = self._segment(q[seg.rows], k[seg.rows], v[seg.rows], layer, seg)
        return self.o_proj(out.view(n, -1))

    def _segment(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, seg: Segment) -> torch.Tensor:
        """``q [T, Hq, D]`` over the cached prefix and the segment's own ``k`` / ``v [T, Hkv, D]``."""
        t = q.shape[0]
        num_cached = seg.cache.num_cached(layer)
        keys, values = seg.cache.extended(layer, k.transpose(0, 1), v.transpose(0, 1))  # [Hkv, S, D], S = n + T
        mask = None
        if not seg.is_canvas:
            seg.cache.append(layer, keys, values)
            q_pos = torch.arange(seg.start_pos, seg.start_pos + t)[:, None]  # [T, 1]
            kv_pos = torch.arange(seg.start_pos - num_cached, seg.start_pos + t)[None, :]  # [1, S]
            mask = kv_pos <= q_pos  # [T, S] causal
            if self.window is not None:
                mask &= kv_pos > q_pos - self.window
        groups = self.num_heads // keys.shape[0]
        keys = keys.repeat_interleave(groups, dim=0)  # [Hq, S, D]
        values = values.repeat_interleave(groups, dim=0)
        # Gemma 4 normalizes q and k instead of scaling the scores
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=1.0)  # [Hq, T, D]
        return o.transpose(0, 1)


class MLP(nn.Module):
    """The dense gated MLP every layer has beside its experts."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Gemma 4's router: a scale-free RMS norm, a learned per-channel scale, softmax top-k, per-expert scales."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.eps = config.rms_norm_eps
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, H]`` -> ``(weights [N, K], expert_ids [N, K])``, each row's picks in ascending expert order."""
        h = unit_rms_norm(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        weights, expert_ids = route(self.proj(h), self.top_k, normalize=True)  # [N, K]
        return weights * self.per_expert_scale[expert_ids], expert_ids


class Experts(nn.Module):
    """The routed experts, stacked as transformers 5 holds them (gate rows, then up rows)."""

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        n, k = expert_ids.shape
        flat = expert_ids.reshape(-1)  # [N K]: slot s is row s // K's pick s % K
        order = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        rows = x.index_select(0, order // k)  # [N K, H], grouped by expert
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                gate, up = F.linear(rows[start:start + count], self.gate_up_proj[expert]).chunk(2, dim=-1)
                outs.append(F.linear(gelu_tanh(gate) * up, self.down_proj[expert]))  # [count, H]
                start += count
        grouped = torch.cat(outs) * weights.reshape(-1, 1).index_select(0, order)  # [N K, H]
        picks = torch.empty_like(grouped).index_copy_(0, order, grouped).view(n, k, -1)  # [N, K, H]
        y = picks[:, 0]
        for j in range(1, k):  # ascending expert order, whoever shares the forward
            y = y + picks[:, j]
        return y


class Layer(nn.Module):
    """Attention, then the dense MLP and the experts side by side (both from the same residual)."""

    def __init__(self, config: DiffusionGemmaConfig, spec: LayerSpec) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, spec)
        self.mlp = MLP(h, config.intermediate_size)
        self.router = Router(config)
        self.experts = Experts(config)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(h, eps))
        # the encoder's and the denoiser's layer scalars are buffers of their own (not tied)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                segments: Sequence[Segment], is_canvas_row: torch.Tensor, requests: Sequence[slice]) -> torch.Tensor:
        """``x [N, H]`` -> ``[N, H]``; ``is_canvas_row [N, 1]`` picks each row's layer scalar.

        ``requests`` are the rows of each request: its experts run on them alone, because a
        matmul's bits can depend on how many rows it has, and an expert's share of the rows
        would otherwise depend on who shares the forward.
        """
        residual = x
        x = residual + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, layer, segments))
        residual = x
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        weights, expert_ids = self.router(x)  # routed on the residual, before any norm
        normed = self.pre_feedforward_layernorm_2(x)
        sparse = self.post_feedforward_layernorm_2(torch.cat([
            self.experts(normed[r], weights[r], expert_ids[r]) for r in requests]))
        x = residual + self.post_feedforward_layernorm(dense + sparse)
        return x * torch.where(is_canvas_row, self.layer_scalar, self.encoder_layer_scalar)
