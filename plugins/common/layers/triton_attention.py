"""Paged attention over a ragged step in one Triton kernel: prefill chunks (against their prefix's
blocks) and decode tokens alike, with a causal sliding window and per-head sink logits where a
family needs them (Gemma 4's sliding layers; gpt-oss's sliding layers and sinks).

``paged_attention(q, k_cache, v_cache, attn, scale=..., window=..., sinks=...)`` computes what the
torch paths compute (``attention.paged_attention``, ``gemma4.windowed_attention``,
``gpt_oss.sink_attention``): query ``i`` of sequence ``b`` at position ``p`` sees the keys at
positions ``max(0, p - window + 1) .. p`` of its context; a sink adds one logit per head to the
softmax whose probability is dropped. Softmax in float32 (online, block by block), any K/V dtype.

One program is a tile of up to ``BLOCK_Q`` query tokens of one sequence and one query head; it
visits only the blocks that tile's window reaches. The tiles are laid out on the host from
``AttnMetadata``'s host copies, so the launch never waits on the device.

Imports without Triton (``HAS_TRITON`` False); ``TRITON_INTERPRET=1`` before the first import runs
it on CPU tensors.
"""

from __future__ import annotations

import math
import weakref

import torch

from ifb_plugins.common.layers.attention import AttnMetadata
from ifb_plugins.common.layers.triton_kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

#: query tokens per program (``tl.dot`` needs at least 16 rows)
BLOCK_Q = 16

if HAS_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, sinks_ptr,
        tile_seq_ptr, tile_q0_ptr, q_start_ptr, q_lens_ptr, seq_lens_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
        qk_scale, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, IS_FP32: tl.constexpr,
    ):
        tile = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        kv_head = head // GROUP
        seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
        q0 = tl.load(tile_q0_ptr + tile)  # the tile's first query, counted within its sequence
        first = tl.load(q_start_ptr + seq)  # the sequence's first flat token
        q_len = tl.load(q_lens_ptr + seq)
        ctx = tl.load(seq_lens_ptr + seq)

        rows = q0 + tl.arange(0, BLOCK_Q)
        row_ok = rows < q_len
        qpos = ctx - q_len + rows  # each query's position in its context
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        tokens = (first + rows).to(tl.int64)
        q_raw = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

        if HAS_SINKS:  # the sink is one more logit, worth nothing: start the running sum at it
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            m_i = tl.zeros([BLOCK_Q], dtype=tl.float32) + sink
            l_i = tl.zeros([BLOCK_Q], dtype=tl.float32) + 1.0
        else:
            m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, DIM_PAD], dtype=tl.float32)

        last = tl.minimum(ctx - q_len + q0 + BLOCK_Q, ctx)  # one past the tile's last visible key
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx - q_len + q0 - window + 1, 0) // BLOCK_SIZE
        slots = tl.arange(0, BLOCK_SIZE)
        kv_in_block = kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :]
        for j in range(lo, tl.cdiv(last, BLOCK_SIZE)):
            block = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)
            kpos = j * BLOCK_SIZE + slots
            kv_mask = (kpos < ctx)[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + block * stride_kb + kv_in_block, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + block * stride_kb + kv_in_block, mask=kv_mask, other=0.0)
            if IS_FP32:  # float32 products in float32 (no TF32), as the torch path computes them
                s = tl.dot(q_raw.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:  # 16-bit queries and keys on the tensor cores, accumulated in float32
                s = tl.dot(q_raw, tl.trans(k.to(q_raw.dtype)))
            s = s * qk_scale  # [BQ, BS]; qk_scale folds in log2(e): the softmax runs on exp2
            visible = (kpos[None, :] <= qpos[:, None]) & (kpos < ctx)[None, :]
            if HAS_WINDOW:
                visible = visible & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IS_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q_raw.dtype), v.to(q_raw.dtype))
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def query_tiles(query_lens: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The programs' (sequence, first query within it) for a step's query lengths."""
    seqs, starts = [], []
    for b, n in enumerate(query_lens):
        for q0 in range(0, n, BLOCK_Q):
            seqs.append(b)
            starts.append(q0)
    return seqs, starts


#: each step's tile tensors, made once and read by every layer (the metadata lives one step)
_TILES: weakref.WeakKeyDictionary[AttnMetadata, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()


def _step_tiles(attn: AttnMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
    tiles = _TILES.get(attn)
    if tiles is None or tiles[0].device != device:
        seqs, starts = query_tiles(attn.query_lens_host)
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        tiles = (as_int32(seqs), as_int32(starts), attn.query_start_loc.to(device=device, dtype=torch.int32),
                 as_int32(attn.query_lens_host), as_int32(attn.seq_lens_host), attn.block_tables.to(device).contiguous())
        _TILES[attn] = tiles
    return tiles


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata, *,
                    scale: float | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's queries ``q [T, Hq, D]`` over the paged cache (its own K/V already
    written); ``scale`` defaults to ``1 / sqrt(D)``, ``window`` (tokens) to none, ``sinks [Hq]`` to
    none. Returns ``[T, Hq, D]`` in ``q``'s dtype."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton kernels need the 'triton' package, which is not installed")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share q's head dim, one shape and one layout")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if block_size & (block_size - 1) or block_size < 16:
        raise ValueError(f"the kernel takes power-of-two KV blocks of at least 16 slots, not {block_size}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    tiles = _step_tiles(attn, q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    tile_seq, tile_q0, q_start, q_lens, seq_lens, tables = tiles
    _paged_attention_kernel[(tile_seq.shape[0], num_heads)](
        q, k_cache, v_cache, out, tables, sinks if sinks is not None else q, tile_seq, tile_q0, q_start, q_lens,
        seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), tables.stride(0),
        float(scale) * math.log2(math.e), int(window or 0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=BLOCK_Q, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        IS_FP32=q.dtype == torch.float32,
    )  # fmt: skip
    return out


def attention_kernel(*, scale: float | None = None, window: int | None = None, sinks: torch.Tensor | None = None):
    """``paged_attention`` bound to a layer's settings, with ``attention.paged_attention``'s signature."""

    def kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, attn, scale=scale, window=window, sinks=sinks)

    return kernel
