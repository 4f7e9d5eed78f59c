"""The Gated DeltaNet linear-attention mixer of Qwen3.5 over a ragged step, with per-seat state.

``in_proj_qkv`` → causal depthwise conv with SiLU (the conv window per seat,
as Mamba's) → q, k, v per head; q and k L2-normalized, q scaled by
``1/sqrt(d_k)``, each key head shared by ``Hv / Hk`` value heads. Per head and
token, with ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``::

    S = S * exp(g)                         S: [d_k, d_v], the seat's state
    S = S + k ⊗ ((v - S^T k) * beta)       the delta rule
    o = S^T q

then ``norm(o) * silu(z)`` per head and ``out_proj``.

transformers runs prefill in the chunked (UT-transform) form and decode in the
recurrent form. Here both run the recurrent form, one token at a time per
sequence: a prompt's state is then the same bits however the engine splits it
into prefill chunks and whichever batch mates share the step (what batched ==
alone needs), and a capture inside a chunk is just the state after its token.
The two forms agree to float32 rounding (tests compare against transformers'
chunked prefill at 1e-4).

Shape letters: T tokens, Hk / Hv key / value heads, Dk / Dv their widths.
"""

from __future__ import annotations

import torch
from torch import nn

from ifb_plugins.common.layers.moe import exp_sigmoid
from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.ffn import TokenLinear
from ifb_plugins.mamba.layout import StepLayout
from ifb_plugins.mamba.mixer import ragged_conv
from ifb_plugins.mamba.numerics import silu, softplus


class HeadGatedRMSNorm(nn.Module):
    """``weight * rmsnorm(o) * silu(z)`` per head (norm, then gate: Qwen3.5's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(o.dtype)) * silu(z.float())


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of seats: ``state [B, Hv, Dk, Dv]``, ``q/k [B, Hv, Dk]``, ``v [B, Hv, Dv]``,
    ``decay = exp(g)`` and ``beta`` ``[B, Hv]``; returns ``(new state, o [B, Hv, Dv])``."""
    state = state * decay[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # S^T k: [B, Hv, Dv]
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(dim=-2)


class GatedDeltaNet(nn.Module):
    """Parameter names as transformers' ``Qwen3_5GatedDeltaNet`` (``A`` held as ``-exp(A_log)``)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = self.config = config
        h, hv = c.hidden_size, c.linear_num_value_heads
        self.key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        self.in_proj_qkv = TokenLinear(h, c.conv_dim, bias=False)
        self.in_proj_z = TokenLinear(h, c.linear_value_dim, bias=False)
        self.in_proj_b = TokenLinear(h, hv, bias=False)
        self.in_proj_a = TokenLinear(h, hv, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=False,
                                padding=c.conv_kernel - 1)
        self.register_buffer("A", torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.zeros(hv))
        self.norm = HeadGatedRMSNorm(c.linear_value_head_dim, c.layer_norm_epsilon)
        self.out_proj = TokenLinear(c.linear_value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, layout: StepLayout, conv_state: torch.Tensor, state: torch.Tensor,
                captures: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]) -> torch.Tensor:
        """One step over ``x [T, hidden]``; advances the seats' conv window and state and fills
        ``captures`` (conv and state copies, by capture id) at the layout's capture points."""
        c = self.config
        t = x.shape[0]
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        qkv = ragged_conv(self.in_proj_qkv(x), layout, conv_state, captures[0], self.conv1d.weight[:, 0, :], None)
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, c.linear_value_dim], dim=-1)
        q = l2norm(q.reshape(t, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk ** -0.5
        k = l2norm(k.reshape(t, hk, dk)).repeat_interleave(hv // hk, dim=1)
        v = v.reshape(t, hv, dv)
        beta = exp_sigmoid(self.in_proj_b(x).float())
        decay = torch.exp(self.A.float() * softplus(self.in_proj_a(x).float() + self.dt_bias.float()))
        o = torch.empty(t, hv, dv, dtype=torch.float32, device=x.device)
        if layout.has_decode:
            i, seats = layout.decode_token_idx, layout.decode_seats
            new, o[i] = delta_step(state.index_select(0, seats).float(), q[i], k[i], v[i], decay[i], beta[i])
            state.index_copy_(0, seats, new.to(state.dtype))
            for seat, capture_id in layout.decode_captures:
                captures[1][capture_id] = state[seat].clone()
        for scan in layout.prefill_rounds:
            idx = scan.token_idx.tolist()
            for n, seat in enumerate(scan.seats):
                rows = state[seat:seat + 1].float()
                for j in idx[scan.cu_seqlens[n]:scan.cu_seqlens[n + 1]]:
                    rows, o[j:j + 1] = delta_step(rows, q[j:j + 1], k[j:j + 1], v[j:j + 1], decay[j:j + 1],
                                                  beta[j:j + 1])
                state[seat] = rows[0].to(state.dtype)
            for seat, capture_id in scan.captures:
                captures[1][capture_id] = state[seat].clone()
        z = self.in_proj_z(x).reshape(t, hv, dv)
        out = self.norm(o.to(x.dtype), z).reshape(t, c.linear_value_dim)
        return self.out_proj(out.to(x.dtype))
