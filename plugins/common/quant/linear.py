"""Run a GGUF checkpoint's quantized matrices as they are stored, instead of in float32.

A decode step reads every weight once, so on a CPU its speed is set by the
bytes it streams: the default model's 4-bit blocks are about a sixth of its
float32 weights. These modules multiply the GGUF blocks directly
(``quant.parts.BlockParts`` picks them for a ``TextModel``'s projections and
output head as the model is built):

- ``BlockLinear`` (the default): the native kernels of ``qkernels``. By
  default each input row is quantized per block of 32 to codes of about 15
  bits and multiplied in integers (``activations="int16"``; ``"int8"`` is
  llama.cpp's coarser and faster 8-bit scheme); with ``"float32"`` (the
  ``weights-only`` quantization mode) they rebuild each block's weights in
  float32 exactly as the float32 path's dequantization does, so the model
  differs from the float32 one by summation order only. Q4_0, Q4_1 and Q8_0
  (the default model's tied embedding, hence its output head) are read.
- ``BlockLinear`` also runs Q4_K, Q6_K, Q5_K and Q5_1, decoded once at load
  into kinds of the interleaved kernels (``Kernels.interleave_kquant``), and
  Q5_0, rewritten as Q8_0 blocks (``q5_0_as_q8_0``, exact): int16 / int8
  activations, the bits of the rows multiplied as stored.
- ``StoredBlockLinear``: the native kernels' ``stored_matmul`` on rows as the
  file stores them (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), with int16 / int8
  activations: the interleaved kinds' reference.
- ``quant_torch.BlockTorchLinear`` for those types otherwise (no native
  kernels, or float32 activations): the same integer scheme in torch, the
  same bits as the native kernels' (it is their reference).
- ``quant_torch.Int4Linear``, when the native kernels cannot be built: torch's
  int4pack matmul on bfloat16 activations, Q4_0 / Q4_1 only.

A GGUF that mixes types (``Q4_K_M``: Q4_K, Q6_K and Q8_0 tensors) runs each
tensor on its own type's path.

Mixture-of-experts layers: each routed expert's gate/up and down become block
matmuls of their own (``moe.ExpertModules``), cut from llama.cpp's stacked
``ffn_*_exps`` tensors per expert, blocks untouched, of every type above and MXFP4
(gpt-oss's experts, rewritten exactly as Q8_0 blocks by ``mxfp4_as_q8_0``); ``moe.SparseMoE`` gathers
the rows routed to an expert and multiplies them in one call. The router stays
in float32.

Q/K/V and gate/up are fused into one matmul each where their types agree (their
rows are concatenated, ``concat``; the GGUF loader has already put llama.cpp's
permuted Q/K rows back in order, and rows move whole, so the blocks are
untouched). Both backends compute a row of the output independently of the
other rows in the call, so batched greedy output stays identical to solo output.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Literal

import attrs
import gguf
import numpy as np
import torch
from torch import nn

from ifb_plugins.common.quant import kernels as qkernels, blocks as quant_blocks, int4_torch as quant_torch
from ifb_plugins.common.loading.gguf import GGUFTensor

log = logging.getLogger("ifb.text")

Q = gguf.GGMLQuantizationType
#: weights per block
BLOCK = 32
#: block types the interleaved kernels multiply: their kind number (Q4_K, Q6_K, Q5_K and Q5_1 decoded at
#: load by ``Kernels.interleave_kquant``)
KINDS = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q8_0: 2, Q.Q4_K: 3, Q.Q6_K: 4, Q.Q5_K: 5, Q.Q5_1: 5}
#: output columns side by side in the interleaved layout (``csrc/matmul_layout.h``)
GROUP_COLUMNS = 16
#: the kinds whose codes are nibbles (byte i holds weights i and i + 16)
_NIBBLE_KINDS = (0, 1, 3)
#: code bytes a column and block, after its scales: the nibble kinds 16, K6 24 (16 nibble bytes, 8 of
#: 2-bit planes), the others 32
_CODE_BYTES = {0: 16, 1: 16, 3: 16, 4: 24}
#: K6's weight i = 16h + 4u + j: its top 2 bits are bits 2u of byte j of plane h
_K6_PLANE_BYTE = (torch.arange(32) // 16 * 4 + torch.arange(32) % 4)
_K6_PLANE_SHIFT = (torch.arange(32) % 16 // 4 * 2).to(torch.int16)
#: the stacked expert tensors' types put on block matmuls: every type read as stored (Q5_0 and MXFP4
#: rewritten as Q8_0 blocks for the interleaved kernels, ``native_form``)
EXPERT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.MXFP4)
#: every block type read as stored (the rest are dequantized to float32 at load)
STORED = tuple(quant_blocks.SUBBLOCK)
BLOCK_BYTES = dict(quant_blocks.BLOCK_BYTES)
#: bits per weight code
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6, Q.Q8_0: 8, Q.MXFP4: 4}
#: the MXFP4 exponents whose scale ``2^(e - 128)`` a float16 holds exactly (2^-24 .. 2^15)
MXFP4_HALF_EXPONENTS = range(104, 144)

Backend = Literal["native", "torch-int4"]


@attrs.frozen(eq=False)
class BlockWeight:
    """A GGUF matrix ``[N, K]`` as stored: ``blocks`` is ``[N, K / block weights * block bytes]`` uint8.

    Each row is its blocks in GGUF's layout (for Q4_0 / Q4_1 / Q8_0: float16
    scale, for Q4_1 a float16 minimum, then the codes; K-quants: super-blocks
    of 256), rows in HF order.
    """

    qtype: gguf.GGMLQuantizationType
    blocks: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.in_features

    @property
    def bits(self) -> int:
        return BITS[self.qtype]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``, as the float32 path computes it."""
        values = gguf.quants.dequantize(self.blocks.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)

    def to_int4pack(self) -> quant_torch.Int4Weight:
        """The same 4-bit weight in torch int4pack's convention ``w = (q - 8) * scale + zero``."""
        if self.qtype not in (Q.Q4_0, Q.Q4_1):
            raise ValueError("only Q4_0 / Q4_1 weights map onto torch's int4 kernel")
        n, k = self.shape
        blocks = self.blocks.view(n, k // BLOCK, BLOCK_BYTES[self.qtype])
        scale = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
        packed = blocks[..., -16:]
        # Byte i of a block holds weight i in its low nibble and weight i + 16 in its high one.
        codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.int32).view(n, k)
        if self.qtype == Q.Q4_1:
            zero = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0] + 8 * scale
        else:  # Q4_0: w = d * (q - 8)
            zero = torch.zeros_like(scale)
        return quant_torch.Int4Weight(codes, scale, zero)


def read_blocks(tensor: GGUFTensor, types: Iterable[gguf.GGMLQuantizationType] = KINDS) -> BlockWeight | None:
    """A matrix of one of ``types`` (by default those the native kernels multiply, ``KINDS``;
    ``STORED``: every type read as stored) as a ``BlockWeight``; None for any other."""
    if tensor.ggml_type not in types or len(tensor.shape) != 2:
        return None
    n, k = tensor.shape
    data = np.ascontiguousarray(tensor.data).reshape(n, -1).copy()  # off the file's read-only map
    tensor.release()
    return BlockWeight(tensor.ggml_type, torch.from_numpy(data), k)


def read_expert_blocks(tensor: GGUFTensor) -> list[BlockWeight] | None:
    """A stacked expert tensor (``ffn_*_exps``, ``[E, N, K]``) as one ``BlockWeight`` per expert
    (its rows as stored); None for types the kernels do not read."""
    if tensor.ggml_type not in EXPERT_TYPES or len(tensor.shape) != 3:
        return None
    experts = list(iter_expert_blocks(tensor))
    tensor.release()
    return experts


def iter_expert_blocks(tensor: GGUFTensor) -> Iterator[BlockWeight]:
    """``read_expert_blocks``, one expert at a time (its rows copied off the map as it is taken): a
    load holds one expert's copy at a time; the caller releases the tensor once it is read."""
    e, n, k = tensor.shape
    data = np.ascontiguousarray(tensor.data).reshape(e, n, -1)
    for i in range(e):
        yield BlockWeight(tensor.ggml_type, torch.from_numpy(data[i].copy()), k)


def mxfp4_as_q8_0(weight: BlockWeight) -> BlockWeight:
    """An MXFP4 matrix as the same weights in Q8_0 blocks: each block's doubled e2m1 values
    (-12..12) as int8 codes and its scale ``2^(e - 128)`` as the float16 ``d`` (exact), so the
    interleaved Q8_0 kernels multiply it with the bits of ``quant_blocks``' MXFP4 reference.

    Raises ``ValueError`` when a block with a nonzero weight has a scale no float16 holds (outside
    2^-24 .. 2^15: ``MXFP4_HALF_EXPONENTS``); such a matrix stays on the torch reference."""
    if weight.qtype != Q.MXFP4:
        raise ValueError(f"expected MXFP4 blocks, got {weight.qtype.name}")
    n, k = weight.shape
    raw = weight.blocks.numpy().reshape(n, k // BLOCK, 17)
    nibbles = raw[..., 1:]
    index = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1)  # weights 0..15, then 16..31
    codes = np.asarray(gguf.quants.MXFP4.kvalues, dtype=np.int8)[index]
    exponent = raw[..., 0].astype(np.int32)
    used = (codes != 0).any(-1)
    outside = used & ((exponent < MXFP4_HALF_EXPONENTS.start) | (exponent >= MXFP4_HALF_EXPONENTS.stop))
    if outside.any():
        raise ValueError(f"{int(outside.sum())} MXFP4 blocks have scales no float16 holds")
    d = np.where(used, np.ldexp(np.float32(1.0), exponent - 128), 0.0).astype(np.float16)
    out = np.empty((n, k // BLOCK, 34), np.uint8)
    out[..., :2] = d[..., None].view(np.uint8)
    out[..., 2:] = codes.view(np.uint8)
    return BlockWeight(Q.Q8_0, torch.from_numpy(out.reshape(n, -1)), k)


def native_form(weight: BlockWeight, *, integer_activations: bool) -> BlockWeight:
    """``weight`` in the block type the interleaved kernels take for it: Q5_0 (with integer
    activations) and MXFP4 rewritten as Q8_0 blocks (exact), the rest as they are."""
    if weight.qtype == Q.Q5_0 and integer_activations:
        return q5_0_as_q8_0(weight)
    if weight.qtype == Q.MXFP4:
        try:
            return mxfp4_as_q8_0(weight)
        except ValueError as exc:
            log.warning("%s: kept on the torch path", exc)
    return weight


def q5_0_as_q8_0(weight: BlockWeight) -> BlockWeight:
    """A Q5_0 matrix as the same weights in Q8_0 blocks: each block's scale d kept, its 5-bit codes
    ``q - 16`` stored as int8 (exact), so the interleaved Q8_0 kernels multiply it with the bits
    ``stored_matmul`` gives the Q5_0 rows."""
    if weight.qtype != Q.Q5_0:
        raise ValueError(f"expected Q5_0 blocks, got {weight.qtype.name}")
    n, k = weight.shape
    raw = weight.blocks.numpy().reshape(n, k // BLOCK, 22)
    high = raw[..., 2:6].copy().view(np.uint32)  # [n, blocks, 1]: bit i is weight i's fifth bit
    nibbles = raw[..., 6:]
    low = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).astype(np.int16)  # weights 0..15, 16..31
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    codes = (low | fifth << 4) - 16
    out = np.empty((n, k // BLOCK, 34), np.uint8)
    out[..., :2] = raw[..., :2]
    out[..., 2:] = codes.astype(np.int8).view(np.uint8)
    return BlockWeight(Q.Q8_0, torch.from_numpy(out.reshape(n, -1)), k)


def concat(parts: list[BlockWeight]) -> BlockWeight:
    """Stack weights of one type along the output axis (a fused projection): rows move whole."""
    if len({p.qtype for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
        raise ValueError("fused parts need one block type and one input width")
    return BlockWeight(parts[0].qtype, torch.cat([p.blocks for p in parts]), parts[0].in_features)


class BlockLinear(nn.Module):
    """``nn.Linear``'s call signature over GGUF blocks, computed by the native kernels (float32 out)."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None, kernels: qkernels.Kernels, *,
                 activations: qkernels.Activations = "int16") -> None:
        super().__init__()
        if activations not in qkernels.ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(qkernels.ACTIVATIONS)}, not {activations!r}")
        #: how input rows are multiplied (``Kernels.block_matmul``)
        self.activations = activations
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        if weight.qtype not in KINDS:  # quant_torch.BlockTorchLinear multiplies the other types
            raise ValueError(f"the native kernels do not multiply {weight.qtype.name} blocks")
        self.kind = KINDS[weight.qtype]
        if self.kind >= 3 and activations == "float32":
            raise ValueError(f"{weight.qtype.name} blocks take int16 or int8 activations")
        #: the blocks interleaved for the kernels (``Kernels.interleave``, ``Kernels.interleave_kquant``)
        blocks = (kernels.interleave_kquant(weight.blocks, int(weight.qtype)) if self.kind >= 3
                  else kernels.interleave(weight.blocks, self.kind))
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:  # the C code would read past the rows
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self.kernels.block_matmul(rows, self.blocks, self.kind, self.out_features, self.bias,
                                        activations=self.activations)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` (any shape) in float32, read back from the interleaved blocks: each
        value as ``gguf`` dequantizes the file's rows (the same float32 operations on the same
        scales and codes), so a tied embedding looked up here is the float32 table's."""
        flat = ids.reshape(-1).long()
        k, kind, cols = self.in_features, self.kind, GROUP_COLUMNS
        nb, block_bytes, sup = k // BLOCK, qkernels.BLOCK_BYTES[kind], cols * qkernels.SUPER_BYTES[kind]
        rows = self.blocks.view(-1, cols * qkernels.kind_row_bytes(kind, k))[flat // cols]  # the groups' rows
        lane = (flat % cols).view(-1, 1, 1)

        def lanes(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            """[T, A, 16 * size] bytes as the lane's value of each of A: [T, A] float32."""
            part = part.contiguous().view(dtype)
            return part.gather(2, lane.expand(-1, part.shape[1], 1)).squeeze(2).float()

        if sup:  # each super-block of 8 blocks starts with its head (d, and K4's dmin)
            parts = rows.view(len(flat), nb // 8, sup + 8 * cols * block_bytes)
            supers, groups = parts[..., :sup], parts[..., sup:].reshape(len(flat), nb, cols * block_bytes)
        else:
            groups = rows.view(len(flat), nb, cols * block_bytes)
        # the 16 columns' scales (and minima) come before their codes
        head = cols * (block_bytes - _CODE_BYTES.get(kind, 32))
        chunks = groups[:, :, head:].reshape(len(flat), nb, -1, cols, 4)
        index = lane.view(-1, 1, 1, 1, 1).expand(-1, nb, chunks.shape[2], 1, 4)
        codes = chunks.gather(3, index).reshape(len(flat), nb, -1)  # the lane's code bytes, in order
        if kind in _NIBBLE_KINDS:  # byte i holds weights i (low nibble) and i + 16 (high)
            codes = torch.cat([codes & 15, codes >> 4], dim=-1)
        elif kind == 4:  # 6-bit codes q: low 4 bits as the nibble kinds', top 2 bits in planes; q - 32
            low = torch.cat([codes[..., :16] & 15, codes[..., :16] >> 4], dim=-1).to(torch.int16)
            top = (codes[..., 16 + _K6_PLANE_BYTE].to(torch.int16) >> _K6_PLANE_SHIFT) & 3
            codes = (low | top << 4) - 32
        elif kind == 2:  # stored + 128
            codes = (codes ^ 0x80).view(torch.int8)
        values = codes.float()
        if kind == 3:  # d * sc and -(dmin * m), exact in float32, as gguf's dequantization
            d = lanes(supers[..., :2 * cols], torch.float16).repeat_interleave(8, dim=1)
            dmin = lanes(supers[..., 2 * cols:], torch.float16).repeat_interleave(8, dim=1)
            sc, mn = lanes(groups[..., :cols], torch.uint8), lanes(groups[..., cols:2 * cols], torch.uint8)
            values = (d * sc)[..., None] * values + (-(dmin * mn))[..., None]
        elif kind == 4:  # d * sc of each half block
            d = lanes(supers, torch.float16).repeat_interleave(8, dim=1)
            halves = [d * lanes(groups[..., i * cols:(i + 1) * cols], torch.int8) for i in (0, 1)]
            values = torch.stack(halves, dim=-1).repeat_interleave(BLOCK // 2, dim=-1) * values
        elif kind == 5:  # float32 scales and minima per column
            f = groups[:, :, :head].contiguous().view(torch.float32).view(len(flat), nb, 2, cols)
            f = f.gather(3, lane.view(-1, 1, 1, 1).expand(-1, nb, 2, 1)).squeeze(3)  # [T, nb, 2]
            values = f[..., :1] * values + f[..., 1:]
        else:  # float16 d (and Q4_1's m) per column
            h = groups[:, :, :head].contiguous().view(torch.float16).view(len(flat), nb, -1, GROUP_COLUMNS)
            h = h.gather(3, lane.view(-1, 1, 1, 1).expand(-1, nb, h.shape[2], 1)).squeeze(3).float()
            if self.kind == 0:
                values = h[..., :1] * (values - 8)
            elif self.kind == 1:
                values = h[..., :1] * values + h[..., 1:]
            else:
                values = h[..., :1] * values
        return values.reshape(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype.name} blocks, "
                f"{self.activations} activations")


class StoredBlockLinear(nn.Module):
    """``nn.Linear``'s call signature over GGUF rows kept as stored (Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K), computed by ``Kernels.stored_matmul`` with integer activations (float32 out)."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None, kernels: qkernels.Kernels, *,
                 activations: qkernels.Activations = "int16") -> None:
        super().__init__()
        if int(weight.qtype) not in qkernels.STORED_TYPES:
            raise ValueError(f"the native kernels do not read {weight.qtype.name} rows as stored")
        if activations not in ("int16", "int8"):
            raise ValueError(f"stored blocks take int16 or int8 activations, not {activations!r}")
        self.activations = activations
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        self.register_buffer("blocks", weight.blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self.kernels.stored_matmul(rows, self.blocks, int(self.qtype), self.bias, activations=self.activations)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype.name} blocks "
                f"as stored, {self.activations} activations")


class BlockEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a GGUF matrix kept in its blocks ``[V, row bytes]``: each row
    looked up is dequantized as ``gguf`` dequantizes the whole table, so the rows are the float32
    table's, for a quarter or less of its memory (the table is read a few rows a step)."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("blocks", weight.blocks.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1)].numpy()
        values = np.ascontiguousarray(gguf.quants.dequantize(rows, self.qtype), dtype=np.float32)
        return torch.from_numpy(values).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} blocks"


class HeadEmbedding(nn.Module):
    """A tied embedding looked up in the output head's interleaved blocks (``BlockLinear.weight_rows``):
    the float32 table's rows, and no second copy of the table's blocks."""

    def __init__(self, head: BlockLinear) -> None:
        super().__init__()
        self.qtype = head.qtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self._heads = (head,)  # a plain reference: the head's buffers stay the head's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._heads[0].weight_rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, the output head's {self.qtype.name} blocks"


@attrs.frozen
class QuantizationReport:
    """What ``quant.parts.BlockParts`` put on blocks, for the load log."""

    backend: Backend | None
    num_quantized: int
    num_kept: int
    head: str
    activations: str = "float32"
    #: of ``num_quantized``, those on ``quant_torch.BlockTorchLinear`` (types without a native kernel)
    num_torch: int = 0
    #: the token embedding's GGUF type when it is looked up in blocks (``BlockEmbedding``)
    embedding_blocks: str | None = None
    #: whether those blocks are the tied output head's (``HeadEmbedding``: no copy of its own)
    is_embedding_in_head: bool = False

    def describe(self) -> str:
        if self.backend is None:
            return "float32"
        torch_note = f" ({self.num_torch} of them in torch, by their block type)" if self.num_torch else ""
        whose = "the output head's" if self.is_embedding_in_head else "its"
        embedding = f", embedding looked up in {whose} {self.embedding_blocks} blocks" if self.embedding_blocks else ""
        return (f"{self.num_quantized} projections on GGUF blocks ({self.backend}, {self.activations} "
                f"activations){torch_note}, "
                f"{self.num_kept} in float32, output head {self.head}{embedding}")


def choose_backend() -> Backend | None:
    """``native`` when the kernels build here, else ``torch-int4`` when torch has it, else None."""
    if qkernels.load() is not None:
        return "native"
    if quant_torch.supported():
        log.warning("running the GGUF's 4-bit weights with torch's int4 kernel (bfloat16 activations) instead")
        return "torch-int4"
    log.warning("no quantized matmul is available here: running the GGUF in float32")
    return None
