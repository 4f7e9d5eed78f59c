"""GGUF blocks as integer codes with float32 sub-block scales, and the integer-activation matmul in torch.

Every block type read as stored is, per sub-block of ``G`` weights (32, or 16
for Q6_K), ``w = scale * code (+ min)``: integer codes, a float32 scale that
is exact (a float16 times a small integer), and for the affine types a
float32 minimum per 32 weights:

- Q4_0 / Q5_0 / Q8_0: ``code = q - 8`` / ``q - 16`` / ``q``, ``scale = d``;
- Q4_1 / Q5_1: ``code = q``, ``scale = d``, ``min = m``;
- Q4_K / Q5_K (super-blocks of 256): ``code = q``, ``scale = d * sc_j``,
  ``min = -dmin * m_j`` (6-bit ``sc_j``, ``m_j`` per 32);
- Q6_K (super-blocks of 256): ``code = q - 32``, ``scale = d * sc_j`` (int8
  ``sc_j`` per 16);
- MXFP4 (gpt-oss's experts): ``code`` the doubled e2m1 value of each 4-bit index
  (``gguf.quants.MXFP4.kvalues``, -12..12), ``scale = 2^(e - 128)`` (the block's
  8-bit exponent ``e``, as ggml's ``e8m0_to_fp32_half``).

``block_matmul`` is the reference of the native kernels' integer scheme
(``csrc/matmul_int.h``): each input row is quantized per 32-block to codes
(``int16``: about 15 bits, as two int8 parts; ``int8``: 8 bits) with scale
``xs`` and code sum; each sub-block's product ``S`` is an exact integer sum;
then, sub-block by sub-block in one fixed order, with one rounding each (a
fused multiply-add, emulated exactly in float64 here)::

    acc = fma(float32(S) * xs, scale, acc)        # every sub-block
    acc = fma(min, xs * sum(code_x), acc)         # affine types, once per 32

so a row's result never depends on the other rows of the call.
"""

from __future__ import annotations

import attrs
import gguf
import torch

Q = gguf.GGMLQuantizationType
#: activation codes per 32-block: the largest code (``qkernels.ACTIVATIONS``)
LEVELS = {"int16": 32512.0, "int8": 127.0}
#: weights per sub-block (one scale) of each type read as stored
SUBBLOCK = {Q.Q4_0: 32, Q.Q4_1: 32, Q.Q8_0: 32, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 16,
            Q.MXFP4: 32}
#: MXFP4's e2m1 values doubled, by 4-bit index
MXFP4_VALUES = torch.tensor(gguf.quants.MXFP4.kvalues, dtype=torch.int8)
#: weights per block as GGUF stores them, and bytes per block
BLOCK_WEIGHTS = {t: gguf.GGML_QUANT_SIZES[t][0] for t in SUBBLOCK}
BLOCK_BYTES = {t: gguf.GGML_QUANT_SIZES[t][1] for t in SUBBLOCK}
#: bytes of output a chunk of the matmul's exact block sums may take
_CHUNK_BYTES = 64 << 20


@attrs.frozen(eq=False)
class BlockCodes:
    """``[N, K]`` weights as ``scale * code + min`` per sub-block.

    ``codes`` ``[N, K]`` int8; ``scales`` ``[N, K / group]`` float32; ``mins``
    ``[N, K / 32]`` float32 or None (no offset).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weights (``scale * code`` then ``+ min``, each rounded to float32)."""
        n, k = self.codes.shape
        w = (self.codes.view(n, -1, self.group).float() * self.scales[..., None]).view(n, k)
        if self.mins is not None:
            w = (w.view(n, -1, 32) + self.mins[..., None]).view(n, k)
        return w


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 bytes ``[..., 2]`` as float32 ``[...]``."""
    return raw.contiguous().view(torch.float16).float()[..., 0]


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """Bits 0..count-1 of little-endian words ``[..., count / 8]`` bytes, as uint8 ``[..., count]``."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw[..., :, None] >> shifts) & 1).reshape(*raw.shape[:-1], count)


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., L]`` as their low nibbles then their high ones, ``[..., 2 L]``."""
    return torch.cat((raw & 0x0F, raw >> 4), dim=-1)


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minima, ``([..., 8], [..., 8])`` as float32."""
    d, m, md = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """8-bit exponents (uint8) as float32 ``2^(e - 128)``, exactly (ggml's ``e8m0_to_fp32_half``)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def decode(qtype: Q, blocks: torch.Tensor) -> BlockCodes:
    """GGUF rows ``[N, row bytes]`` (uint8) of ``qtype`` as ``BlockCodes``."""
    if qtype not in SUBBLOCK:
        raise ValueError(f"{qtype.name} blocks are not read as stored")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[qtype])  # [N, blocks, bytes]
    mins = None
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        head = 4 if qtype in (Q.Q4_1, Q.Q5_1) else 2
        scales = _f16(b[..., 0:2])
        if head == 4:
            mins = _f16(b[..., 2:4])
        if qtype == Q.Q8_0:
            codes = b[..., 2:].view(torch.int8)
        elif qtype in (Q.Q4_0, Q.Q4_1):
            codes = _nibbles(b[..., head:]).to(torch.int8) - (8 if qtype == Q.Q4_0 else 0)
        else:  # Q5: 32 high bits (a little-endian word), then 16 bytes of low nibbles
            high = _bits(b[..., head:head + 4], 32)
            codes = (_nibbles(b[..., head + 4:]) | (high << 4)).to(torch.int8) - (16 if qtype == Q.Q5_0 else 0)
    elif qtype == Q.MXFP4:  # one exponent byte, then 16 bytes: weights i (low nibble) and i + 16 (high)
        scales = e8m0_half(b[..., 0])
        codes = MXFP4_VALUES[_nibbles(b[..., 1:]).long()]
    elif qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        scales, mins = d[..., None] * sc, -(dmin[..., None] * mn)  # exact: 11 bits times 6
        # 4 runs of 32 bytes: a run's low nibbles are sub-block 2i, its high nibbles 2i + 1
        low = b[..., -128:].reshape(n, -1, 4, 32)
        low = torch.stack((low & 0x0F, low >> 4), dim=-2).reshape(n, -1, 8, 32)
        if qtype == Q.Q5_K:  # bit j of byte i: the fifth bit of weight i of sub-block j
            shifts = torch.arange(8, dtype=torch.uint8)[:, None]
            low = low | (((b[..., 16:48][..., None, :] >> shifts) & 1) << 4)
        codes = low.to(torch.int8)
    elif qtype == Q.Q6_K:
        ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        scales = _f16(b[..., 208:210])[..., None] * sc
        # each half of 128 weights: 64 bytes of low nibbles (weights 0-63, then 64-127), and
        # 32 bytes holding two high bits for 4 runs of 32
        low = torch.cat((ql & 0x0F, ql >> 4), dim=-1)  # [N, blocks, 2, 128]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        high = ((qh[..., None, :] >> shifts) & 3).reshape(n, -1, 2, 128)
        codes = (low | (high << 4)).to(torch.int8) - 32
    else:  # pragma: no cover - SUBBLOCK lists the types above
        raise AssertionError(qtype)
    k = b.shape[1] * BLOCK_WEIGHTS[qtype]
    return BlockCodes(codes.reshape(n, k).contiguous(), scales.reshape(n, -1).contiguous(),
                      None if mins is None else mins.reshape(n, -1).contiguous(), SUBBLOCK[qtype])


@attrs.frozen(eq=False)
class RowCodes:
    """Input rows ``[M, K]`` as the integer scheme takes them: float64 codes (integers), per
    32-block float32 scales ``xs`` and ``xsum = xs * sum(codes)`` (``[M, K / 32]``)."""

    codes: torch.Tensor
    xs: torch.Tensor
    xsum: torch.Tensor


def quantize_rows(x: torch.Tensor, activations: str) -> RowCodes:
    """Codes ``round(x * L / max|x|)`` (ties to even) per 32-block, as ``csrc``'s quantize_blocks.

    15-bit codes are ``256 h + l`` with ``h = round(code / 256)`` and ``l`` clamped
    to -127..127 (the two int8 parts the kernels multiply).
    """
    levels = LEVELS[activations]
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    top = blocks.abs().amax(-1)
    inv = torch.where(top > 0, torch.full_like(top, levels) / top, torch.zeros_like(top))
    codes = (blocks * inv[..., None]).round().clamp(-levels, levels)
    if activations == "int16":
        high = (codes * (1.0 / 256.0)).round()
        codes = 256 * high + (codes - 256 * high).clamp(-127, 127)
    xs = top / levels
    xsum = xs * codes.sum(-1)  # the sum is an integer below 2^24: exact in float32
    return RowCodes(codes.double().reshape(m, k), xs, xsum)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors rounded once to float32, as C's ``fmaf``.

    The product is exact in float64; the sum is rounded to odd there (TwoSum
    gives its error), and a float64 rounded to odd rounds to float32 correctly.
    """
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))
    bits = s.view(torch.int64)
    # inexact and even: step one unit towards the exact value (away from zero when err has s's sign)
    step = torch.where((err != 0) & (bits & 1 == 0), torch.where((err > 0) == (s > 0), 1, -1), 0)
    return (bits + step).view(torch.float64).float()


def block_matmul(x: torch.Tensor, qtype: Q, blocks: torch.Tensor, bias: torch.Tensor | None,
                 activations: str) -> torch.Tensor:
    """``x [M, K]`` times GGUF rows ``blocks [N, row bytes]`` of ``qtype``: float32 ``[M, N]``.

    ``int16`` / ``int8`` follow the integer scheme above exactly; ``float32``
    multiplies the dequantized weights row by row (one matrix-vector product per
    row, so a row's sums do not depend on how many rows share the call).
    """
    m, k = x.shape
    n = blocks.shape[0]
    if activations == "float32":
        weights = decode(qtype, blocks).dequantize()
        out = torch.stack([weights @ row for row in x.float()]) if m else x.new_zeros(0, n)
        return out if bias is None else out + bias
    rows = quantize_rows(x, activations)
    group = SUBBLOCK[qtype]
    nsub = k // group
    xg = rows.codes.view(m, nsub, group).transpose(0, 1)  # [subs, M, G]
    xs = rows.xs.repeat_interleave(32 // group, dim=1)  # each sub-block's activation scale
    out = torch.empty(m, n, dtype=torch.float32)
    step = max(1, _CHUNK_BYTES // (8 * max(m, 1) * nsub))
    for j0 in range(0, n, step):
        w = decode(qtype, blocks[j0:j0 + step])
        wg = w.codes.view(-1, nsub, group).permute(1, 2, 0).double()  # [subs, G, n]
        # [subs, M, n]: exact integer sums (float64), then rounded to float32 as C converts an int32
        sums = torch.bmm(xg, wg).float()
        acc = torch.zeros(m, wg.shape[-1], dtype=torch.float32)
        for s in range(nsub):
            acc = fma32(sums[s] * xs[:, s:s + 1], w.scales[:, s], acc)
            if w.mins is not None and (s + 1) * group % 32 == 0:
                b = (s + 1) * group // 32 - 1
                acc = fma32(w.mins[:, b].expand_as(acc), rows.xsum[:, b:b + 1].expand_as(acc), acc)
        out[:, j0:j0 + step] = acc if bias is None else acc + bias[j0:j0 + step]
    return out
