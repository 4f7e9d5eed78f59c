"""GGUF blocks times activations in one Triton kernel: each weight tile is dequantized from the
file's bytes, block by block, inside the matmul (no float copy of the matrix is ever made).

``block_matmul(x, qtype, blocks, in_features)`` is ``x @ dequantize(blocks).T`` for Q4_0, Q8_0,
Q4_K and Q6_K: ``blocks [N, K / block weights * block bytes]`` uint8, as ``quant.linear.BlockWeight``
holds them (rows in Hugging Face order, each row its blocks in GGUF's layout). Each weight is
rebuilt as ``gguf.quants.dequantize`` builds it (float16 scales widened to float32, then
``scale * code`` and, for Q4_K, ``- dmin * m``), so the kernel's weights equal the reference's bit
for bit; the products accumulate in float32 (``ieee`` precision for float32 activations; bfloat16 or
float16 activations multiply the weights rounded to that dtype).

Like ``layers.triton_kernels``, this imports without Triton (``HAS_TRITON`` False) and binds to the
interpreter when ``TRITON_INTERPRET=1`` is set before the first import.
"""

from __future__ import annotations

import gguf
import torch

from ifb_plugins.common.layers.triton_kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

Q = gguf.GGMLQuantizationType
#: the block types the kernel dequantizes, with its constexpr code for each
TYPES = {Q.Q4_0: 0, Q.Q8_0: 1, Q.Q4_K: 2, Q.Q6_K: 3}
#: weights and bytes per block of each type
QK = {t: gguf.GGML_QUANT_SIZES[t][0] for t in TYPES}
BYTES = {t: gguf.GGML_QUANT_SIZES[t][1] for t in TYPES}


if HAS_TRITON:

    @triton.jit
    def _byte(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _f16(ptr, mask):
        # a little-endian float16 from two bytes, widened to float32 (exact)
        bits = _byte(ptr, mask) | (_byte(ptr + 1, mask) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _weights(base, j, mask, QTYPE: tl.constexpr):
        """The float32 weights at offset ``j`` (in weights) of the blocks starting at ``base``."""
        if QTYPE == 0:  # Q4_0: d, then 16 bytes: weight i in the low nibble of byte i, i + 16 in the high
            d = _f16(base, mask)
            q = (_byte(base + 2 + (j % 16), mask) >> (4 * (j // 16))) & 0xF
            w = d * (q - 8).to(tl.float32)
        elif QTYPE == 1:  # Q8_0: d, then 32 int8 codes
            d = _f16(base, mask)
            q = _byte(base + 2 + j, mask)
            w = d * (q - 256 * (q >> 7)).to(tl.float32)
        elif QTYPE == 2:  # Q4_K: d, dmin, 12 bytes of 6-bit (scale, min) pairs, then 128 bytes of nibbles
            d = _f16(base, mask)
            dmin = _f16(base + 2, mask)
            sub = j // 32
            low = sub < 4
            a = _byte(base + 4 + sub, mask)
            b = _byte(base + 4 + sub + 4, mask)
            c = _byte(base + 4 + tl.where(low, sub, sub - 4), mask)
            sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
            m = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
            q = (_byte(base + 16 + 32 * (j // 64) + (j % 32), mask) >> (4 * (sub % 2))) & 0xF
            w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * m.to(tl.float32)
        else:  # Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d
            half = j // 128
            quarter = (j % 128) // 32
            lane = j % 32
            lo = _byte(base + 64 * half + lane + 32 * (quarter % 2), mask) >> (4 * (quarter // 2))
            hi = _byte(base + 128 + 32 * half + lane, mask) >> (2 * quarter)
            q = ((lo & 0xF) | ((hi & 3) << 4)) - 32
            s = _byte(base + 192 + 8 * half + lane // 16 + 2 * quarter, mask)
            d = _f16(base + 208, mask)
            w = (d * (s - 256 * (s >> 7)).to(tl.float32)) * q.to(tl.float32)
        return w

    @triton.jit
    def _block_matmul_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr,
        M, N, K, row_bytes, stride_xm, stride_om,
        QTYPE: tl.constexpr, BLOCK_WEIGHTS: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
        IS_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rm < M
        col_ok = rn < N
        rows = w_ptr + rn.to(tl.int64)[:, None] * row_bytes  # [BN, 1]: each output row's blocks
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            base = rows + (rk // BLOCK_WEIGHTS)[None, :] * BLOCK_BYTES
            w = _weights(base, (rk % BLOCK_WEIGHTS)[None, :], col_ok[:, None] & k_ok[None, :], QTYPE)  # [BN, BK]
            if IS_FP32:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def supports(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether the kernel dequantizes ``qtype``'s blocks."""
    return qtype in TYPES


def block_matmul(x: torch.Tensor, qtype: gguf.GGMLQuantizationType, blocks: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` for the GGUF matrix ``W [N, K]`` stored as ``blocks`` (see the
    module docstring); the result has ``x``'s dtype."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton kernels need the 'triton' package, which is not installed")
    if qtype not in TYPES:
        raise ValueError(f"no Triton block matmul for {qtype.name}")
    n, row_bytes = blocks.shape
    if in_features % QK[qtype] or row_bytes != in_features // QK[qtype] * BYTES[qtype]:
        raise ValueError(f"{qtype.name} rows of {row_bytes} bytes do not hold {in_features} weights")
    if x.shape[-1] != in_features:
        raise ValueError(f"activations of width {x.shape[-1]} for a matrix of {in_features} columns")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    blocks = blocks.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block_m = 16 if rows.shape[0] <= 16 else 64
        grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(n, 64))
        _block_matmul_kernel[grid](
            rows, blocks, bias if bias is not None else blocks, out,
            rows.shape[0], n, in_features, row_bytes, rows.stride(0), out.stride(0),
            QTYPE=TYPES[qtype], BLOCK_WEIGHTS=QK[qtype], BLOCK_BYTES=BYTES[qtype], HAS_BIAS=bias is not None,
            IS_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
