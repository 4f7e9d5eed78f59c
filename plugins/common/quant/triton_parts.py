"""The parts of a ``TextModel`` built for a CUDA device: the Triton kernels, chosen as the model is built.

``DeviceParts`` is the ``models.parts.ModelParts`` of a deployment on ``--device cuda``:

- every layer's attention on ``layers.triton_attention`` (prefill chunks and decode tokens of a
  ragged step in one kernel over the paged cache);
- for a GGUF file, each projection stored as Q4_0, Q8_0, Q4_K or Q6_K a ``TritonBlockLinear``:
  the file's bytes on the device, dequantized block by block inside the matmul
  (``quant.triton_blocks``); Q/K/V and gate/up as one matmul where they share a type. A tensor
  of another type, the embedding and the head keep their floating modules (``build_model`` loads
  them in the deployment's dtype).

The CPU deployments keep ``ModelParts`` (torch) and ``quant.parts.BlockParts`` (the native kernels).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ifb_plugins.common.layers import triton_attention
from ifb_plugins.common.loading.gguf import GGUFTensor
from ifb_plugins.common.models.parts import ModelParts
from ifb_plugins.common.quant import triton_blocks
from ifb_plugins.common.quant.linear import BlockWeight, concat, read_blocks


class TritonBlockLinear(nn.Module):
    """``y = x @ W.T + b`` for a GGUF matrix ``W`` held as its blocks (``quant.triton_blocks``)."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not triton_blocks.supports(weight.qtype):
            raise ValueError(f"no Triton block matmul for {weight.qtype.name}")
        self.qtype = weight.qtype
        self.in_features = weight.in_features
        self.out_features = weight.blocks.shape[0]
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_blocks.block_matmul(x, self.qtype, self.blocks, self.in_features, self.bias)

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, in_features={self.in_features}, out_features={self.out_features}"


class DeviceParts(ModelParts):
    """``ModelParts`` for a CUDA device (see the module docstring). ``raw`` is a GGUF file's
    ``read_gguf_tensors`` (None: a Hugging Face checkpoint, nothing on blocks) and ``state`` its
    state dict (the biases of the block matmuls)."""

    def __init__(self, raw: Mapping[str, GGUFTensor] | None = None,
                 state: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.raw = raw or {}
        self.state = state or {}
        self.num_quantized = self.num_kept = 0

    @classmethod
    def for_checkpoint(cls, loaded: object) -> DeviceParts:
        """The parts of a loaded checkpoint (``loading.checkpoint.LoadedCheckpoint``)."""
        if loaded.source != "gguf":  # type: ignore[attr-defined]
            return cls()
        from ifb_plugins.common.loading.gguf import read_gguf_tensors

        return cls(read_gguf_tensors(loaded.path), loaded.state_dict)  # type: ignore[attr-defined]

    def _weight(self, name: str) -> BlockWeight | None:
        tensor = self.raw.get(f"{name}.weight")
        if tensor is None or not triton_blocks.supports(tensor.ggml_type):
            return None
        return read_blocks(tensor, tuple(triton_blocks.TYPES))

    def _bias(self, names: Sequence[str], bias: bool) -> torch.Tensor | None:
        if not bias:
            return None
        self.consumed.update(f"{n}.bias" for n in names)
        return torch.cat([self.state[f"{n}.bias"].detach() for n in names])

    def fused(self, name: str, parts: Sequence[tuple[str, int]], in_features: int, bias: bool) -> nn.Module | None:
        names = [p for p, _ in parts]
        weights = [self._weight(p) for p in names]
        if not all(w is not None for w in weights) or len({w.qtype for w in weights}) != 1:  # type: ignore[union-attr]
            return None
        self.consumed.update(f"{p}.weight" for p in names)
        self.num_quantized += len(names)
        with torch.device("cpu"):
            return TritonBlockLinear(concat(weights), self._bias(names, bias))  # type: ignore[arg-type]

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        weight = self._weight(name)
        if weight is None:
            self.num_kept += bool(self.raw)
            return super().linear(name, in_features, out_features, bias)
        self.consumed.add(f"{name}.weight")
        self.num_quantized += 1
        with torch.device("cpu"):
            return TritonBlockLinear(weight, self._bias([name], bias))

    def attention(self, name: str) -> Callable[..., torch.Tensor]:
        return triton_attention.attention_kernel()

    def describe(self, dtype: torch.dtype) -> str:
        """What the parts built, for the load log."""
        name = str(dtype).removeprefix("torch.")
        if not self.raw:
            return f"{name}; Triton attention"
        return (f"{self.num_quantized} projections on GGUF blocks (Triton), {self.num_kept} in {name}; "
                f"Triton attention")
