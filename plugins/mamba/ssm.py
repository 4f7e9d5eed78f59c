"""The Mamba-2 recurrence per seat: causal conv state and selective state space update.

Per seat the state is ``conv [C, K-1]`` (the last K-1 conv inputs) and
``ssm [H, P, N]``. For one token with head inputs ``x [H, P]``, raw step
``dt [H]`` and group projections ``B, C [G, N]`` (head h reads group
``h // (H / G)``)::

    dt    = clamp(softplus(dt + dt_bias), *limit)
    state = state * exp(dt * A) + (dt * x) ⊗ B        A = -exp(A_log)
    y     = state · C + D * x

A decode advances a batch of seats by one token (``selective_state_update``);
a prefill chunk advances one seat by several tokens, continuing from the
state the previous chunk left (``chunk_scan``). The torch path of the chunk
scan runs the decode step token by token, so prefill and decode — and every
way of chunking a prompt — give bit-identical states on CPU. On CUDA both run
as Triton kernels (``triton_kernels``).

Shape letters: B seats in a call, H heads, P head dim, N state size, G
groups, C conv channels, K conv kernel, T tokens.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ifb_plugins.mamba.numerics import silu, softplus

DtLimit = tuple[float, float]
NO_LIMIT: DtLimit = (0.0, math.inf)


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors; everything else takes the torch path."""
    if not t.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ---- causal depthwise conv ----

def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of ``x [B, C, T]`` continuing from ``state [B, C, K-1]``, then SiLU.

    Returns ``(y [B, C, T], new_state [B, C, K-1])``. The taps are summed in a
    fixed order per output, so a token's value does not depend on ``T``.
    """
    num_tokens, kernel = x.shape[-1], weight.shape[-1]
    window = torch.cat([state.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]
    acc = window[..., 0:num_tokens] * weight[:, 0:1]
    for k in range(1, kernel):
        acc = acc + window[..., k:k + num_tokens] * weight[:, k:k + 1]
    if bias is not None:
        acc = acc + bias[:, None]
    return silu(acc), window[..., num_tokens:].contiguous()


# ---- selective state space ----

def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
               limit: DtLimit) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw ``dt [..., H]`` to ``(dt, exp(dt * A))`` (both ``[..., H]``, float32)."""
    dt = softplus(dt.float() + dt_bias.float())
    if limit != NO_LIMIT:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt, torch.exp(dt * A.float())


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Group projections ``[..., G, N]`` repeated to ``[..., H, N]``."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def _step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA: torch.Tensor, B: torch.Tensor,
          C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch: ``state [B, H, P, N]``, ``x [B, H, P]``, ``dt/dA [B, H]``, ``B/C [B, H, N]``."""
    new = state * dA[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
    y = (new * C[:, :, None, :]).sum(-1) + D[None, :, None] * x
    return new, y


def selective_state_update_ref(state: torch.Tensor, seats: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                               A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                               dt_bias: torch.Tensor, limit: DtLimit = NO_LIMIT) -> torch.Tensor:
    """Torch path of ``selective_state_update``."""
    num_heads = x.shape[1]
    dt, dA = discretize(dt, dt_bias, A, limit)
    rows = state.index_select(0, seats)
    new, y = _step(rows, x.float(), dt, dA, _heads(B.float(), num_heads), _heads(C.float(), num_heads), D.float())
    state.index_copy_(0, seats, new.to(state.dtype))
    return y.to(x.dtype)


def chunk_scan_ref(state: torch.Tensor, seats: Sequence[int], cu_seqlens: Sequence[int], x: torch.Tensor,
                   dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                   dt_bias: torch.Tensor, limit: DtLimit = NO_LIMIT) -> torch.Tensor:
    """Torch path of ``chunk_scan``: the decode step, token by token, per sequence."""
    num_heads = x.shape[1]
    dt, dA = discretize(dt, dt_bias, A, limit)
    xf, Bh, Ch, Df = x.float(), _heads(B.float(), num_heads), _heads(C.float(), num_heads), D.float()
    y = torch.empty_like(xf)
    for i, seat in enumerate(seats):
        rows = state[seat:seat + 1].float()
        for t in range(cu_seqlens[i], cu_seqlens[i + 1]):
            rows, y[t:t + 1] = _step(rows, xf[t:t + 1], dt[t:t + 1], dA[t:t + 1], Bh[t:t + 1], Ch[t:t + 1], Df)
        state[seat] = rows[0].to(state.dtype)
    return y.to(x.dtype)


def selective_state_update(state: torch.Tensor, seats: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                           A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                           dt_bias: torch.Tensor, limit: DtLimit = NO_LIMIT) -> torch.Tensor:
    """Advance seats ``seats [B]`` of ``state [seats, H, P, N]`` by one token each; returns ``y [B, H, P]``.

    ``x [B, H, P]``, raw ``dt [B, H]``, ``B/C [B, G, N]``; ``A`` (already
    ``-exp(A_log)``), ``D``, ``dt_bias`` are ``[H]``. Updates ``state`` in place.
    """
    if use_triton(x):
        from ifb_plugins.mamba.triton_kernels import selective_state_update_triton

        return selective_state_update_triton(state, seats, x, dt, A, B, C, D, dt_bias, limit)
    return selective_state_update_ref(state, seats, x, dt, A, B, C, D, dt_bias, limit)


def chunk_scan(state: torch.Tensor, seats: Sequence[int], cu_seqlens: Sequence[int], x: torch.Tensor,
               dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
               dt_bias: torch.Tensor, limit: DtLimit = NO_LIMIT) -> torch.Tensor:
    """Scan packed prefill chunks: sequence i owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` of
    ``x [T, H, P]``, ``dt [T, H]``, ``B/C [T, G, N]`` and continues from seat ``seats[i]``.

    Returns ``y [T, H, P]``; each seat's state is left after its last token.
    """
    if use_triton(x):
        from ifb_plugins.mamba.triton_kernels import chunk_scan_triton

        return chunk_scan_triton(state, seats, cu_seqlens, x, dt, A, B, C, D, dt_bias, limit)
    return chunk_scan_ref(state, seats, cu_seqlens, x, dt, A, B, C, D, dt_bias, limit)
