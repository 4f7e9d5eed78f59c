"""The Mamba-2 mixer over a ragged step, with per-seat state and optional state captures.

``in_proj`` → (gate ``z``, ``xBC``, ``dt``) → causal depthwise conv over
``xBC`` with SiLU → selective state space update → grouped gated RMSNorm
``norm(y * silu(z))`` → ``out_proj``. The same mixer serves Nemotron-H, Bamba
and Granite 4.0 hybrid.

A capture copies a seat's conv and SSM state as it stands after a given
token of the step (prefix reuse keeps those copies as checkpoints). Inside a
prefill chunk the scan runs in rounds that stop at the capture points; the
scan is exact under any split (``ssm``), so rounds do not change a bit.
"""

from __future__ import annotations

import torch
from torch import nn

from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.ffn import TokenLinear
from ifb_plugins.mamba.layout import StepLayout
from ifb_plugins.mamba.numerics import silu
from ifb_plugins.mamba.ssm import causal_conv, chunk_scan, selective_state_update


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


def ragged_conv(xbc: torch.Tensor, layout: StepLayout, conv_state: torch.Tensor, captures: dict[int, torch.Tensor],
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv (then SiLU) of a step's tokens ``xbc [T, C]``, each sequence continuing
    from its seat's ``conv_state [seats, C, K-1]``; fills conv ``captures`` at the layout's points.
    ``weight [C, K]``. Shared by the Mamba-2 and Gated DeltaNet mixers."""
    keep = weight.shape[-1] - 1
    out = torch.empty_like(xbc)
    if layout.has_decode:
        idx, seats = layout.decode_token_idx, layout.decode_seats
        y, new = causal_conv(xbc[idx][:, :, None], conv_state.index_select(0, seats), weight, bias)
        out[idx] = y[:, :, 0]
        conv_state.index_copy_(0, seats, new)
        for seat, capture_id in layout.decode_captures:
            captures[capture_id] = conv_state[seat].clone()
    if layout.has_prefill:
        packed = xbc[layout.prefill_token_idx]
        result = torch.empty_like(packed)
        cu = layout.prefill_cu_seqlens
        for i, seat in enumerate(layout.prefill_seats):
            chunk = packed[cu[i]:cu[i + 1]].t()[None]  # [1, C, n]
            if layout.conv_captures[i]:
                # the state after t tokens is the last K-1 inputs up to t: a window of (old state | chunk)
                window = torch.cat([conv_state[seat].to(chunk.dtype), chunk[0]], dim=-1)  # [C, K-1+n]
                for t, capture_id in layout.conv_captures[i]:
                    captures[capture_id] = window[:, t:t + keep].clone()
            y, new = causal_conv(chunk, conv_state[seat:seat + 1], weight, bias)
            result[cu[i]:cu[i + 1]] = y[0].t()
            conv_state[seat] = new[0]
        out[layout.prefill_token_idx] = result
    return out


class Mamba2Mixer(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = self.config = config
        inner = c.mamba_intermediate
        self.in_proj = TokenLinear(c.hidden_size, inner + c.conv_dim + c.mamba_num_heads, bias=c.mamba_proj_bias)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=c.use_conv_bias,
                                padding=c.conv_kernel - 1)
        # A = -exp(A_log), made once at load (loader.our_names) or read as a GGUF stores it: recomputing
        # it from a GGUF's log(-A) would not give the file's A back bit for bit
        self.register_buffer("A", torch.zeros(c.mamba_num_heads))
        self.D = nn.Parameter(torch.ones(c.mamba_num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(c.mamba_num_heads))
        self.norm = GatedRMSNorm(inner, c.n_groups, c.layer_norm_epsilon)
        self.out_proj = TokenLinear(inner, c.hidden_size, bias=c.mamba_proj_bias)

    def _conv(self, xbc: torch.Tensor, layout: StepLayout, conv_state: torch.Tensor,
              captures: dict[int, torch.Tensor]) -> torch.Tensor:
        return ragged_conv(xbc, layout, conv_state, captures, self.conv1d.weight[:, 0, :], self.conv1d.bias)

    def forward(self, x: torch.Tensor, layout: StepLayout, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                captures: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]) -> torch.Tensor:
        """One step over ``x [T, hidden]``; advances the seats' state and fills ``captures``
        (conv and SSM copies, by capture id) at the layout's capture points."""
        c = self.config
        num_tokens, heads, groups = x.shape[0], c.mamba_num_heads, c.n_groups
        z, xbc, dt = self.in_proj(x).split([c.mamba_intermediate, c.conv_dim, heads], dim=-1)
        xbc = self._conv(xbc, layout, conv_state, captures[0])
        xs, B, C = xbc.split([c.mamba_intermediate, groups * c.ssm_state_size, groups * c.ssm_state_size], dim=-1)
        xs = xs.reshape(num_tokens, heads, c.mamba_head_dim)
        B = B.reshape(num_tokens, groups, c.ssm_state_size)
        C = C.reshape(num_tokens, groups, c.ssm_state_size)
        A = self.A
        y = torch.empty_like(xs)
        if layout.has_decode:
            i = layout.decode_token_idx
            y[i] = selective_state_update(ssm_state, layout.decode_seats, xs[i], dt[i], A, B[i], C[i],
                                          self.D, self.dt_bias, c.time_step_limit)
            for seat, capture_id in layout.decode_captures:
                captures[1][capture_id] = ssm_state[seat].clone()
        for scan in layout.prefill_rounds:
            i = scan.token_idx
            y[i] = chunk_scan(ssm_state, scan.seats, scan.cu_seqlens, xs[i], dt[i], A, B[i], C[i], self.D,
                              self.dt_bias, c.time_step_limit)
            for seat, capture_id in scan.captures:
                captures[1][capture_id] = ssm_state[seat].clone()
        return self.out_proj(self.norm(y.reshape(num_tokens, c.mamba_intermediate), z))
