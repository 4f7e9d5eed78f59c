"""Triton kernels for the Mamba-2 recurrence (CUDA; tests run them under ``TRITON_INTERPRET=1``).

- ``selective_state_update_triton``: decode. One program per (sequence, head,
  block of head dims) loads the seat's ``[P, N]`` state tile, advances it by
  one token and writes it back with the output.
- ``chunk_scan_triton``: prefill. One program per (sequence, head, block of
  head dims) keeps the state tile in registers and walks the sequence's chunk
  token by token, so a chunk continues exactly from the seat's state and only
  the final state is written back. Sequences of a step run in parallel; within
  a chunk the scan is sequential, which is cheap for the chunk sizes a token
  budget allows.

Both take the same arguments as the torch path in ``ifb_plugins.mamba.ssm``
and match it to float32 rounding.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ifb_plugins.mamba.numerics import SOFTPLUS_THRESHOLD

_THRESHOLD = tl.constexpr(SOFTPLUS_THRESHOLD)


@triton.jit
def _discretize(dt_raw, dt_bias, a, dt_min, dt_max, HAS_LIMIT: tl.constexpr):
    u = dt_raw + dt_bias
    e = tl.exp(tl.minimum(u, _THRESHOLD))
    w = 1.0 + e
    d = w - 1.0
    # log1p(e) with Goldberg's correction, as the torch path computes it.
    sp = tl.where(d == 0.0, e, tl.log(w) * (e / tl.where(d == 0.0, 1.0, d)))
    dt = tl.where(u > _THRESHOLD, u, sp)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt, tl.exp(dt * a)


@triton.jit
def _state_update_kernel(
    state_ptr, seat_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, y_ptr,
    head_dim, state_size, heads_per_group, num_heads, num_groups,
    s_seat, s_head, s_p,
    dt_min, dt_max,
    HAS_LIMIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < state_size
    mask = mask_p[:, None] & mask_n[None, :]
    seat = tl.load(seat_ptr + b).to(tl.int64)
    g = h // heads_per_group

    state_ptrs = state_ptr + seat * s_seat + h * s_head + offs_p[:, None] * s_p + offs_n[None, :]
    state = tl.load(state_ptrs, mask=mask, other=0.0)
    x = tl.load(x_ptr + (b * num_heads + h) * head_dim + offs_p, mask=mask_p, other=0.0)
    dt, da = _discretize(tl.load(dt_ptr + b * num_heads + h), tl.load(dt_bias_ptr + h), tl.load(a_ptr + h),
                         dt_min, dt_max, HAS_LIMIT)
    bv = tl.load(b_ptr + (b * num_groups + g) * state_size + offs_n, mask=mask_n, other=0.0)
    cv = tl.load(c_ptr + (b * num_groups + g) * state_size + offs_n, mask=mask_n, other=0.0)

    state = state * da + (dt * x)[:, None] * bv[None, :]
    y = tl.sum(state * cv[None, :], axis=1) + tl.load(d_ptr + h) * x
    tl.store(state_ptrs, state, mask=mask)
    tl.store(y_ptr + (b * num_heads + h) * head_dim + offs_p, y, mask=mask_p)


@triton.jit
def _chunk_scan_kernel(
    state_ptr, seat_ptr, cu_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, y_ptr,
    head_dim, state_size, heads_per_group, num_heads, num_groups,
    s_seat, s_head, s_p,
    dt_min, dt_max,
    HAS_LIMIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < state_size
    mask = mask_p[:, None] & mask_n[None, :]
    seat = tl.load(seat_ptr + s).to(tl.int64)
    start = tl.load(cu_ptr + s)
    end = tl.load(cu_ptr + s + 1)
    g = h // heads_per_group
    a = tl.load(a_ptr + h)
    dt_bias = tl.load(dt_bias_ptr + h)
    d = tl.load(d_ptr + h)

    state_ptrs = state_ptr + seat * s_seat + h * s_head + offs_p[:, None] * s_p + offs_n[None, :]
    state = tl.load(state_ptrs, mask=mask, other=0.0)
    for t64 in range(start, end):  # int64 bounds (cu_seqlens), so the offsets below are int64
        x = tl.load(x_ptr + (t64 * num_heads + h) * head_dim + offs_p, mask=mask_p, other=0.0)
        dt, da = _discretize(tl.load(dt_ptr + t64 * num_heads + h), dt_bias, a, dt_min, dt_max, HAS_LIMIT)
        bv = tl.load(b_ptr + (t64 * num_groups + g) * state_size + offs_n, mask=mask_n, other=0.0)
        cv = tl.load(c_ptr + (t64 * num_groups + g) * state_size + offs_n, mask=mask_n, other=0.0)
        state = state * da + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(state * cv[None, :], axis=1) + d * x
        tl.store(y_ptr + (t64 * num_heads + h) * head_dim + offs_p, y, mask=mask_p)
    tl.store(state_ptrs, state, mask=mask)


def _launch_args(state: torch.Tensor, x: torch.Tensor, B: torch.Tensor, limit: tuple[float, float]):
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("the SSM state must be float32 with a contiguous last dimension")
    num_heads, head_dim = x.shape[1], x.shape[2]
    num_groups, state_size = B.shape[1], B.shape[2]
    block_n = triton.next_power_of_2(state_size)
    block_p = max(1, min(triton.next_power_of_2(head_dim), max(16, 4096 // block_n)))
    has_limit = limit != (0.0, float("inf"))
    common = (head_dim, state_size, num_heads // num_groups, num_heads, num_groups,
              state.stride(0), state.stride(1), state.stride(2), float(limit[0]), float(limit[1]))
    meta = dict(HAS_LIMIT=has_limit, BLOCK_P=block_p, BLOCK_N=block_n)
    return common, meta, triton.cdiv(head_dim, block_p)


def _f32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float().contiguous() for t in tensors]


def selective_state_update_triton(state: torch.Tensor, seats: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                                  A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                                  dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """Triton ``selective_state_update`` (same contract as the torch path)."""
    num_seqs, num_heads = x.shape[0], x.shape[1]
    xf, dtf, Af, Bf, Cf, Df, biasf = _f32(x, dt, A, B, C, D, dt_bias)
    y = torch.empty_like(xf)
    if num_seqs == 0:
        return y.to(x.dtype)
    common, meta, num_p_blocks = _launch_args(state, xf, Bf, limit)
    seat_ids = seats.to(device=x.device, dtype=torch.int32).contiguous()
    _state_update_kernel[(num_seqs, num_heads, num_p_blocks)](
        state, seat_ids, xf, dtf, Af, Bf, Cf, Df, biasf, y, *common, **meta)
    return y.to(x.dtype)


def chunk_scan_triton(state: torch.Tensor, seats: Sequence[int], cu_seqlens: Sequence[int], x: torch.Tensor,
                      dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                      dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """Triton ``chunk_scan`` (same contract as the torch path)."""
    num_heads = x.shape[1]
    xf, dtf, Af, Bf, Cf, Df, biasf = _f32(x, dt, A, B, C, D, dt_bias)
    y = torch.empty_like(xf)
    if len(seats) == 0:
        return y.to(x.dtype)
    common, meta, num_p_blocks = _launch_args(state, xf, Bf, limit)
    seat_ids = torch.as_tensor(list(seats), dtype=torch.int32, device=x.device)
    cu = torch.as_tensor(list(cu_seqlens), dtype=torch.int64, device=x.device)
    _chunk_scan_kernel[(len(seats), num_heads, num_p_blocks)](
        state, seat_ids, cu, xf, dtf, Af, Bf, Cf, Df, biasf, y, *common, **meta)
    return y.to(x.dtype)
