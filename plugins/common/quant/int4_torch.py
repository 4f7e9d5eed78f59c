"""The fallback 4-bit path: torch's packed int4 weight-only CPU matmul.

Used when the native kernels (``qkernels``) cannot be built. torch's kernel
(``_weight_int4pack_mm_for_cpu``, group size 32) computes with
``w = (q - 8) * scale + zero``, so a GGUF 4-bit block (``w = d * q + m``) maps
onto it exactly with ``scale = d`` and ``zero = m + 8 d``. Its fast path takes
bfloat16 activations and bfloat16 scales (accumulating in float32), so this
path agrees with the float32 one to bfloat16 round-off only. Its result for a
row does not depend on how many rows share the call.

An 8-bit output head (the default model's tied Q8_0 embedding) has no torch
kernel as fast: it is re-quantized to 4 bits per 32-group for the matmul over
the vocabulary, and each row's best candidates are re-scored exactly against
the float32 rows, so greedy picks and top logprobs keep full precision.

``BlockTorchLinear`` multiplies GGUF blocks of every type read as stored
(``quant_blocks``) on the native kernels' integer scheme, bit for bit: their
reference, and the path of the block types they do not multiply.
"""

from __future__ import annotations

import attrs
import gguf
import torch
from torch import nn

from ifb_plugins.common.quant import blocks as quant_blocks
#: weights per quantization group (a GGUF block)
GROUP_SIZE = 32
#: activation (and scale) dtype of the kernel's fast path
ACT_DTYPE = torch.bfloat16
#: the kernel packs output rows in tiles of 16; other counts are padded
ROW_MULTIPLE = 16
#: rows of the output head re-scored exactly after the 4-bit matmul
NUM_RESCORED = 16


def supported() -> bool:
    """Whether this torch build has the packed int4 CPU kernels."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


@attrs.frozen(eq=False)
class Int4Weight:
    """4-bit codes with per-group affine parameters: ``w = (q - 8) * scale + zero``.

    ``codes`` is ``[N, K]`` int32 (0..15); ``scale`` and ``zero`` are ``[N, K / 32]`` float32.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` these codes stand for."""
        n, k = self.shape
        groups = (self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8) * self.scale[..., None]
        return (groups + self.zero[..., None]).view(n, k)


def quantize_float(weight: torch.Tensor) -> Int4Weight:
    """Asymmetric 4-bit quantization of a float ``[N, K]`` matrix, min/max per group of 32."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = ((groups - low[..., None]) * inv[..., None]).round().clamp_(0, 15).to(torch.int32)
    return Int4Weight(codes.view(n, k), scale, low + 8 * scale)


def _concat(parts: list[Int4Weight]) -> Int4Weight:
    return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))


class Int4Linear(nn.Module):
    """``nn.Linear``'s call signature over torch-packed 4-bit weights.

    Takes any float input; the matmul runs on its bfloat16 rounding and returns
    bfloat16 (float32 when there is a bias, which is added in float32).
    """

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % GROUP_SIZE:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {GROUP_SIZE}")
        pad = -self.out_features % ROW_MULTIPLE
        if pad:  # zero rows (scale 0, zero 0), cut off the output again
            groups = self.in_features // GROUP_SIZE
            weight = _concat([weight, Int4Weight(torch.full((pad, self.in_features), 8, dtype=torch.int32),
                                                 torch.zeros(pad, groups), torch.zeros(pad, groups))])
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(weight.codes, 2))
        # The kernel wants [K / 32, N, 2] (scale, zero) in the activation dtype.
        sz = torch.stack((weight.scale, weight.zero), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(ACT_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype != ACT_DTYPE:
            rows = rows.to(ACT_DTYPE)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=4 (torch int4pack)"


class RescoredHead(nn.Module):
    """The output head as a 4-bit matmul over the vocabulary, its top rows re-scored exactly.

    ``weight`` ([V, H] float32) is the reference the re-scoring reads: only
    ``num_rescored`` rows per sequence, so the full matrix is never streamed.
    """

    def __init__(self, weight: torch.Tensor, num_rescored: int = NUM_RESCORED) -> None:
        super().__init__()
        self.approx = Int4Linear(quantize_float(weight))
        self.weight = weight  # shared with the embedding when tied: not a copy
        self.num_rescored = min(num_rescored, weight.shape[0])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.approx(hidden).float()  # [N, V]
        top = logits.topk(self.num_rescored, dim=-1, sorted=False).indices  # [N, k]
        exact = torch.bmm(self.weight[top], hidden.float().unsqueeze(-1)).squeeze(-1)  # [N, k]
        return logits.scatter_(1, top, exact)


class BlockTorchLinear(nn.Module):
    """``nn.Linear``'s call signature over GGUF blocks of any type read as stored, in torch.

    The blocks stay as the file stores them (``blocks`` ``[N, row bytes]``
    uint8) and are decoded chunk by chunk at each call; ``quant_blocks.block_matmul``
    multiplies them on the native kernels' integer scheme (``int16`` / ``int8``,
    the same bits as those kernels) or in float32. The reference of the native
    kernels, and the path for block types they lack. Float32 out.
    """

    def __init__(self, qtype: gguf.GGMLQuantizationType, blocks: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None, *, activations: str = "int16") -> None:
        super().__init__()
        if activations not in ("int16", "int8", "float32"):
            raise ValueError(f"activations must be one of int16, int8, float32, not {activations!r}")
        if qtype not in quant_blocks.SUBBLOCK:
            raise ValueError(f"{qtype.name} blocks are not read as stored")
        if in_features % quant_blocks.BLOCK_WEIGHTS[qtype]:
            raise ValueError(f"in_features {in_features} is not a multiple of {qtype.name}'s block")
        self.qtype = qtype
        self.activations = activations
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        out = quant_blocks.block_matmul(rows, self.qtype, self.blocks, self.bias, self.activations)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype.name} blocks "
                f"(torch), {self.activations} activations")
