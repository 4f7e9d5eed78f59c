"""Hybrid Mamba-2 / attention decoder (Nemotron-H) driven one engine step at a time.

One ``forward`` runs a ragged step (prefill chunks and decode tokens packed on
a flat token axis T). Mamba layers read and advance per-seat recurrent state
in place; attention layers use a paged KV cache. Parameter names follow the
Hugging Face Nemotron-H layout (``backbone.layers.N.mixer.in_proj.weight``, ...).

Every op is written so that a token's numbers do not depend on its batch mates
or on how its prompt was chunked (``numerics``, ``attention``, ``ssm``).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from ifb_plugins.mamba.attention import blockwise_attention
from ifb_plugins.mamba.config import ATTENTION, MAMBA, HybridConfig
from ifb_plugins.mamba.layout import StepLayout
from ifb_plugins.mamba.numerics import silu, token_linear
from ifb_plugins.mamba.ssm import causal_conv, chunk_scan, selective_state_update
from ifb_plugins.common.attention import write_kv
from ifb_plugins.common.model import RMSNorm


@attrs.define
class HybridCache:
    """Per-seat recurrent state of every Mamba layer and the paged KV of every attention layer."""

    conv: list[torch.Tensor]  # per Mamba layer: [seats, conv_dim, K-1]
    ssm: list[torch.Tensor]  # per Mamba layer: [seats, heads, head_dim, state]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: [blocks, block_size, Hkv, D] twice

    def clear_seats(self, seats: list[int]) -> None:
        """Zero the recurrent state of ``seats`` (a new request starts from nothing)."""
        if not seats or not self.conv:
            return
        index = torch.tensor(seats, dtype=torch.long, device=self.conv[0].device)
        for t in (*self.conv, *self.ssm):
            t.index_fill_(0, index, 0.0)


def allocate_cache(config: HybridConfig, num_seats: int, num_blocks: int, block_size: int,
                   device: torch.device | str = "cpu") -> HybridCache:
    """Zeroed state for ``num_seats`` seats and a ``num_blocks``-block KV cache (float32)."""
    c = config

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=device)

    kv_shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    return HybridCache(
        conv=[zeros(num_seats, c.conv_dim, c.conv_kernel - 1) for _ in range(c.num_mamba_layers)],
        ssm=[zeros(num_seats, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size)
             for _ in range(c.num_mamba_layers)],
        kv=[(zeros(*kv_shape), zeros(*kv_shape)) for _ in range(c.num_attention_layers)],
    )


class TokenLinear(nn.Linear):
    """``nn.Linear`` whose rows are computed one token at a time (see ``numerics.token_linear``)."""

    row_invariant = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return token_linear(x, self.weight, self.bias, self.row_invariant)


class GatedRMSNorm(nn.Module):
    """``norm(y * silu(z))`` with the RMS taken over each of ``n_groups`` channel groups."""

    def __init__(self, dim: int, num_groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.num_groups = num_groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * silu(z.float())
        grouped = h.view(*h.shape[:-1], self.num_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(h.shape).to(y.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = self.config = config
        inner = c.mamba_intermediate
        self.in_proj = TokenLinear(c.hidden_size, inner + c.conv_dim + c.mamba_num_heads, bias=c.mamba_proj_bias)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=c.use_conv_bias,
                                padding=c.conv_kernel - 1)
        self.A_log = nn.Parameter(torch.zeros(c.mamba_num_heads))
        self.D = nn.Parameter(torch.ones(c.mamba_num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(c.mamba_num_heads))
        self.norm = GatedRMSNorm(inner, c.n_groups, c.layer_norm_epsilon)
        self.out_proj = TokenLinear(inner, c.hidden_size, bias=c.mamba_proj_bias)

    def _conv(self, xbc: torch.Tensor, layout: StepLayout, conv_state: torch.Tensor) -> torch.Tensor:
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        bias = self.conv1d.bias
        out = torch.empty_like(xbc)
        if layout.has_decode:
            idx, seats = layout.decode_token_idx, layout.decode_seats
            y, new = causal_conv(xbc[idx][:, :, None], conv_state.index_select(0, seats), weight, bias)
            out[idx] = y[:, :, 0]
            conv_state.index_copy_(0, seats, new)
        if layout.has_prefill:
            packed = xbc[layout.prefill_token_idx]
            result = torch.empty_like(packed)
            cu = layout.prefill_cu_seqlens
            for i, seat in enumerate(layout.prefill_seats):
                y, new = causal_conv(packed[cu[i]:cu[i + 1]].t()[None], conv_state[seat:seat + 1], weight, bias)
                result[cu[i]:cu[i + 1]] = y[0].t()
                conv_state[seat] = new[0]
            out[layout.prefill_token_idx] = result
        return out

    def forward(self, x: torch.Tensor, layout: StepLayout, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        c = self.config
        num_tokens, heads, groups = x.shape[0], c.mamba_num_heads, c.n_groups
        z, xbc, dt = self.in_proj(x).split([c.mamba_intermediate, c.conv_dim, heads], dim=-1)
        xbc = self._conv(xbc, layout, conv_state)
        xs, B, C = xbc.split([c.mamba_intermediate, groups * c.ssm_state_size, groups * c.ssm_state_size], dim=-1)
        xs = xs.reshape(num_tokens, heads, c.mamba_head_dim)
        B = B.reshape(num_tokens, groups, c.ssm_state_size)
        C = C.reshape(num_tokens, groups, c.ssm_state_size)
        A = -torch.exp(self.A_log.float())
        y = torch.empty_like(xs)
        if layout.has_decode:
            i = layout.decode_token_idx
            y[i] = selective_state_update(ssm_state, layout.decode_seats, xs[i], dt[i], A, B[i], C[i],
                                          self.D, self.dt_bias, c.time_step_limit)
        if layout.has_prefill:
            i = layout.prefill_token_idx
            y[i] = chunk_scan(ssm_state, layout.prefill_seats, layout.prefill_cu_seqlens, xs[i], dt[i],
                              A, B[i], C[i], self.D, self.dt_bias, c.time_step_limit)
        return self.out_proj(self.norm(y.reshape(num_tokens, c.mamba_intermediate), z))


class Attention(nn.Module):
    """Grouped-query attention over the paged cache; Nemotron-H applies no position embedding."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = self.config = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = TokenLinear(c.hidden_size, q_size, bias=c.attention_bias)
        self.k_proj = TokenLinear(c.hidden_size, kv_size, bias=c.attention_bias)
        self.v_proj = TokenLinear(c.hidden_size, kv_size, bias=c.attention_bias)
        self.o_proj = TokenLinear(q_size, c.hidden_size, bias=c.attention_bias)

    def forward(self, x: torch.Tensor, layout: StepLayout, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        q = self.q_proj(x).view(t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        k_cache, v_cache = kv
        write_kv(k, v, k_cache, v_cache, layout.attn.slot_mapping)
        out = blockwise_attention(q, k_cache, v_cache, layout.attn, layout.token_seq, layout.token_pos)
        return self.o_proj(out.reshape(t, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.up_proj = TokenLinear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = TokenLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())  # relu2


class Block(nn.Module):
    """Pre-norm residual block around one mixer (Mamba, attention or MLP)."""

    def __init__(self, config: HybridConfig, kind: str, state_index: int) -> None:
        super().__init__()
        self.kind = kind
        self.state_index = state_index  # which Mamba state / KV cache of the HybridCache this layer owns
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        mixer = {MAMBA: Mamba2Mixer, ATTENTION: Attention}.get(kind, MLP)
        self.mixer = mixer(config)

    def forward(self, x: torch.Tensor, layout: StepLayout, cache: HybridCache) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == MAMBA:
            h = self.mixer(h, layout, cache.conv[self.state_index], cache.ssm[self.state_index])
        elif self.kind == ATTENTION:
            h = self.mixer(h, layout, cache.kv[self.state_index])
        else:
            h = self.mixer(h)
        return x + h


class Backbone(nn.Module):
    """The ``backbone.`` prefix of Nemotron-H checkpoints."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        counts = {MAMBA: 0, ATTENTION: 0}
        layers = []
        for kind in config.pattern:
            index = counts.get(kind, 0)
            if kind in counts:
                counts[kind] += 1
            layers.append(Block(config, kind, index))
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class HybridModel(nn.Module):
    """A Nemotron-H causal LM whose forward is one ragged engine step."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = TokenLinear(config.hidden_size, config.vocab_size, bias=False)
        self.row_invariant = True

    def set_row_invariant(self, enabled: bool) -> None:
        """Per-token matmuls (batch-invariant, slower) or plain GEMMs."""
        self.row_invariant = enabled
        for module in self.modules():
            if isinstance(module, TokenLinear):
                module.row_invariant = enabled

    def forward(self, input_ids: torch.Tensor, layout: StepLayout, cache: HybridCache) -> torch.Tensor:
        """Run one step over ``input_ids [T]``; returns normed hidden states ``[T, H]``.

        Advances the recurrent state of the step's seats and writes its K/V.
        """
        x = self.backbone.embeddings(input_ids)
        for layer in self.backbone.layers:
            x = layer(x, layout, cache)
        return self.backbone.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[N, H]`` to float32 logits ``[N, V]``."""
        if self.config.tie_word_embeddings:
            weight = self.backbone.embeddings.weight
        else:
            weight = self.lm_head.weight
        return token_linear(hidden, weight, None, self.row_invariant).float()
