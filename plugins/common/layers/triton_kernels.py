"""Triton kernels for the text model's GPU hot ops: RMSNorm and paged decode attention.

They compute what the torch path computes (``model.RMSNorm``,
``attention._decode_attention``) with fp32 accumulation for fp32, fp16 and
bf16 inputs. Triton is a GPU-only dependency: this module imports without it
(``HAS_TRITON`` is then False) and the callers keep their torch path.

Kernels are bound to the interpreter or the compiler when this module is
imported, so ``TRITON_INTERPRET=1`` must be set before the first import to run
them on CPU tensors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ifb_plugins.common.layers.attention import AttnMetadata

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch path serves every op
    triton = None
    tl = None

HAS_TRITON: bool = triton is not None

# A decode program holds [heads, slots, D] fp32 products in registers: larger
# GQA groups are split into tiles of this many query heads, each its own program.
_MAX_HEAD_TILE = 8


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        x_row_stride,
        out_row_stride,
        hidden,
        eps,
        BLOCK_H: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        in_row = cols < hidden
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=in_row, other=0.0)
        xf = x.to(tl.float32)
        mean_sq = tl.sum(xf * xf, axis=0) / hidden
        # Round to the input dtype before scaling by the weight, as the torch path does.
        normed = (xf * (1.0 / tl.sqrt(mean_sq + eps))).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        y = normed * w
        tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=in_row)

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tables_ptr,
        lens_ptr,
        q_stride_b,
        q_stride_h,
        kv_stride_block,
        kv_stride_slot,
        kv_stride_head,
        out_stride_b,
        out_stride_h,
        tables_stride_b,
        qk_scale,
        GROUP: tl.constexpr,
        HEAD_TILE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SLOT_PAD: tl.constexpr,
    ):
        # One program per (sequence, KV head, tile of that KV head's query heads):
        # the tile's query heads share every K/V load.
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        in_group = tl.program_id(2) * HEAD_TILE + tl.arange(0, HEAD_TILE)
        dims = tl.arange(0, DIM_PAD)
        slots = tl.arange(0, SLOT_PAD)
        head_ok = in_group < GROUP
        dim_ok = dims < HEAD_DIM

        q_heads = kv_head * GROUP + in_group
        q_offs = seq * q_stride_b + q_heads[:, None] * q_stride_h + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
        # qk_scale folds in log2(e), so the softmax below runs on exp2.
        q = q.to(tl.float32) * qk_scale  # [G, D]

        seq_len = tl.load(lens_ptr + seq).to(tl.int32)
        m_i = tl.full([HEAD_TILE], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HEAD_TILE], dtype=tl.float32)
        acc = tl.zeros([HEAD_TILE, DIM_PAD], dtype=tl.float32)
        kv_in_slot = kv_head * kv_stride_head + slots[:, None] * kv_stride_slot + dims[None, :]
        for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            block = tl.load(tables_ptr + seq * tables_stride_b + j).to(tl.int64)
            slot_ok = (slots < BLOCK_SIZE) & (j * BLOCK_SIZE + slots < seq_len)
            kv_offs = block * kv_stride_block + kv_in_slot
            kv_mask = slot_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [S, D]
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, S]
            s = tl.where(slot_ok[None, :], s, float("-inf"))
            # Every visited block holds at least one live slot, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new

        # An empty context has nothing to attend to: write zeros rather than 0/0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_offs = seq * out_stride_b + q_heads[:, None] * out_stride_h + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


def applies_to(x: torch.Tensor) -> bool:
    """Whether the kernels should serve an op on ``x``: a CUDA tensor, Triton present, no autograd.

    The kernels have no backward, so anything recording a graph keeps the torch path.
    """
    return x.is_cuda and HAS_TRITON and not torch.is_grad_enabled()


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the Triton kernels need the 'triton' package, which is not installed")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalize ``x [..., H]`` over its last axis and scale by ``weight [H]``.

    Matches ``RMSNorm.forward``: statistics in fp32, the normalized value
    rounded to ``x``'s dtype, then multiplied by ``weight``; the result has
    the promoted dtype of ``x`` and ``weight``.
    """
    _require_triton()
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match hidden size {hidden}")
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        block_h = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), hidden, float(eps),
            BLOCK_H=block_h, num_warps=min(16, max(1, block_h // 256)),
        )  # fmt: skip
    return out.view(x.shape)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    ``q [B, Hq, D]``; ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]``;
    ``block_tables [B, max_blocks]`` block ids in context order; ``seq_lens [B]``
    context lengths (a partial last block is masked). ``Hq`` must be a multiple
    of ``Hkv`` (grouped-query attention); any block size and head dim work, powers
    of two best. Returns ``[B, Hq, D]`` in ``q``'s dtype.
    """
    _require_triton()
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and layout")
    if kv_dim != head_dim:
        raise ValueError(f"query head dim {head_dim} does not match the cache's {kv_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    group = num_q_heads // num_kv_heads
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError("block_tables and seq_lens need one row per sequence")
    if k_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dim must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    head_tile = min(triton.next_power_of_2(group), _MAX_HEAD_TILE)
    dim_pad, slot_pad = triton.next_power_of_2(head_dim), triton.next_power_of_2(block_size)
    _paged_decode_kernel[(num_seqs, num_kv_heads, triton.cdiv(group, head_tile))](
        q, k_cache, v_cache, out, block_tables, seq_lens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        float(scale) * math.log2(math.e),
        GROUP=group,
        HEAD_TILE=head_tile,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        SLOT_PAD=slot_pad,
        num_warps=4 if head_tile * slot_pad * dim_pad <= 8192 else 8,
    )  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata
) -> torch.Tensor:
    """``attention._decode_attention`` on the Triton kernel: the step's decode tokens ``[Bd, Hq, D]``.

    Uses SDPA's default scale, ``1 / sqrt(D)``, as the torch path does.
    """
    return paged_decode_attention(
        q.index_select(0, attn.decode_token_idx),
        k_cache,
        v_cache,
        attn.block_tables.index_select(0, attn.decode_seq_idx),
        attn.seq_lens.index_select(0, attn.decode_seq_idx),
        1.0 / math.sqrt(q.shape[-1]),
    )
