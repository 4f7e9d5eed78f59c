"""The parts of a ``TextModel`` that run a GGUF file's quantized matrices as stored.

``BlockParts`` is the ``models.parts.ModelParts`` of a quantized deployment: as the
model is built it reads each projection's tensor from the file (``read_gguf_tensors``)
and picks its module by block type and backend (``quant.linear``):

- ``BlockLinear`` (the native kernels, interleaved; Q5_0 rewritten as Q8_0 blocks),
  ``StoredBlockLinear`` (rows as stored), ``int4_torch.BlockTorchLinear`` (the same
  integer scheme in torch, for types without a native kernel) or, without the
  native kernels, ``int4_torch.Int4Linear`` (Q4_0 / Q4_1);
- Q/K/V and gate/up as one matmul when their tensors share one block type (rows
  move whole, so the blocks are untouched), else each on its own type's path;
- a mixture-of-experts layer's routed experts as per-expert block matmuls
  (``moe.ExpertModules``, cut from the stacked ``ffn_*_exps`` tensors);
- the native attention kernel, once any projection is on blocks;
- the output head on blocks (``RescoredHead`` with torch's int4 kernel), and the
  token embedding looked up in blocks (the tied head's own, or the table's);
- the native whole-stack decoder (``models.native_decoder.NativeDecoder``) when every
  layer fits it (dense, every projection a ``BlockLinear``), else the layer loop.

A tensor of another type keeps its float32 ``nn.Linear`` (loaded by ``build_model``).
What the parts did is ``report``, for the load log.
"""

from __future__ import annotations

from typing import Callable, Iterable, Literal, Mapping, Sequence

import gguf
import torch
from torch import nn

from ifb_plugins.common.layers.moe import ExpertModules
from ifb_plugins.common.loading.gguf import GGUFTensor, dequantize
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.native_decoder import NativeDecoder, fits_native_decoder
from ifb_plugins.common.models.parts import LayerStack, ModelParts
from ifb_plugins.common.quant import int4_torch as quant_torch, kernels as qkernels
from ifb_plugins.common.quant.linear import (
    EXPERT_TYPES, KINDS, STORED, Backend, BlockEmbedding, BlockLinear, BlockWeight, HeadEmbedding,
    QuantizationReport, StoredBlockLinear, choose_backend, concat, iter_expert_blocks, native_form, read_blocks,
)

Q = gguf.GGMLQuantizationType
#: ``layer_stack`` choices: the native decoder where the layers fit it, or always the layer loop
StackChoice = Literal["auto", "torch"]


class BlockParts(ModelParts):
    """``ModelParts`` over a GGUF file's blocks (see the module docstring).

    ``raw`` is ``loading.gguf.read_gguf_tensors(path)`` (or tensors of that form);
    ``state`` the checkpoint's float32 state dict (biases, and a float32 matrix the
    int4 head re-scores against); ``deferred`` the names in it left unread
    (``load_checkpoint(defer_quantized=True)``). ``backend`` defaults to
    ``choose_backend()``; None there: the float32 modules of ``ModelParts``.
    """

    def __init__(self, config: TextModelConfig, raw: Mapping[str, GGUFTensor], state: Mapping[str, torch.Tensor],
                 backend: Backend | None = None, *, activations: qkernels.Activations = "int16",
                 prompt_activations: qkernels.Activations | None = None,
                 deferred: Iterable[str] = (), layer_stack: StackChoice = "auto") -> None:
        super().__init__()
        if activations not in qkernels.ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(qkernels.ACTIVATIONS)}, not {activations!r}")
        self.config = config
        self.raw = raw
        self.state = state
        self.deferred = frozenset(deferred)
        self.backend = backend or choose_backend()
        self.activations = activations
        #: the native decoder's codes on prompt rows (None: ``activations``; see ``NativeDecoder``)
        self.prompt_activations = prompt_activations
        self.stack_choice = layer_stack
        self.kernels = qkernels.load() if self.backend == "native" else None
        if self.backend == "native" and self.kernels is None:
            raise RuntimeError("the native GGUF kernels cannot be built here (see the warning above)")
        #: K-quant and Q5_0 matrices go on the interleaved kernels (integer activations only)
        self.native_kquants = self.kernels is not None and activations in ("int16", "int8")
        #: whether any projection goes onto blocks (then the head, embedding and attention follow)
        self.has_blocks = self.backend is not None and self._any_projection_on_blocks()
        self.num_quantized = self.num_kept = self.num_torch = 0
        self._pending: dict[str, BlockWeight | None] = {}  # parts read by a fusion that did not happen
        self._head: nn.Module | None = None
        self._head_table: torch.Tensor | None = None  # the float32 matrix an int4 head re-scores against
        self._head_description = "float32"
        self._embedding_blocks: str | None = None
        self._is_embedding_in_head = False
        self._head_done = False

    @classmethod
    def for_checkpoint(cls, loaded: object, backend: Backend | None = None, **options: object) -> BlockParts:
        """The parts of a loaded GGUF checkpoint (``loading.checkpoint.LoadedCheckpoint``)."""
        from ifb_plugins.common.loading.gguf import read_gguf_tensors

        raw = loaded.tensors or read_gguf_tensors(loaded.path)  # type: ignore[attr-defined]
        return cls(loaded.config, raw, loaded.state_dict, backend,  # type: ignore[attr-defined]
                   deferred=loaded.deferred, **options)  # type: ignore[attr-defined, arg-type]

    # --- which tensors go onto blocks ----------------------------------------------------------

    def _block_type(self, name: str) -> Q | None:
        """The block type ``name`` (a projection) runs on, or None: float32. Reads no data."""
        tensor = self.raw.get(f"{name}.weight")
        if tensor is None or tensor.ggml_type not in STORED or len(tensor.shape) != 2:
            return None
        if self.backend == "torch-int4" and tensor.ggml_type == Q.Q8_0:
            return None  # no int4 kernel for it, and torch's integer path would be slower than float32
        if (tensor.ggml_type == Q.Q5_0 and self.native_kquants) or (tensor.ggml_type == Q.MXFP4 and self.kernels is not None):
            return Q.Q8_0  # exact: the interleaved Q8_0 kernels, and fused with Q8_0 parts
        return tensor.ggml_type

    def _expert_types(self, name: str) -> tuple[Q, ...] | None:
        """The block types of a stacked expert tensor's parts (gate, up, down), or None: float32."""
        found = []
        for part in ("gate_proj", "up_proj", "down_proj"):
            tensor = self.raw.get(f"{name}.{part}.weight")
            if tensor is None or tensor.ggml_type not in EXPERT_TYPES or len(tensor.shape) != 3:
                return None
            if self.backend == "torch-int4" and tensor.ggml_type not in (Q.Q4_0, Q.Q4_1):
                return None
            found.append(tensor.ggml_type)
        return tuple(found) if found[0] == found[1] else None

    def _any_projection_on_blocks(self) -> bool:
        c = self.config
        for i in range(c.num_layers):
            prefix = f"model.layers.{i}"
            names = [f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
            if c.is_sparse_layer(i):
                if self._expert_types(f"{prefix}.mlp.experts") is not None:
                    return True
                if c.shared_expert_intermediate_size:
                    names += [f"{prefix}.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
            else:
                names += [f"{prefix}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
            if any(self._block_type(n) is not None for n in names):
                return True
        return False

    def _weight(self, name: str) -> BlockWeight | None:
        if self._block_type(name) is None:
            return None
        return self._native_form(read_blocks(self.raw[f"{name}.weight"], STORED))

    def _native_form(self, weight: BlockWeight) -> BlockWeight:
        """``weight`` as the native kernels take it (``linear.native_form``), unchanged without them."""
        return weight if self.kernels is None else native_form(weight, integer_activations=self.native_kquants)

    def _module(self, weight: BlockWeight, bias: torch.Tensor | None, num_parts: int = 1) -> nn.Module:
        """The block matmul for ``weight`` on this backend (built on the host, whatever device the model is
        built on); ``num_parts`` projections counted in torch when it falls back there."""
        with torch.device("cpu"):
            if self.kernels is not None and weight.qtype in KINDS and (KINDS[weight.qtype] < 3 or self.native_kquants):
                return BlockLinear(weight, bias, self.kernels, activations=self.activations)
            if (self.kernels is not None and int(weight.qtype) in qkernels.STORED_TYPES
                    and self.activations in ("int16", "int8")):
                return StoredBlockLinear(weight, bias, self.kernels, activations=self.activations)
            if self.kernels is None and weight.qtype in (Q.Q4_0, Q.Q4_1):
                return quant_torch.Int4Linear(weight.to_int4pack(), bias)
            self.num_torch += num_parts
            activations = self.activations if self.kernels is not None else "int16"
            return quant_torch.BlockTorchLinear(weight.qtype, weight.blocks, weight.in_features, bias,
                                                activations=activations)

    def _bias(self, names: Sequence[str], bias: bool) -> torch.Tensor | None:
        if not bias:
            return None
        self.consumed.update(f"{n}.bias" for n in names)
        return torch.cat([self.state[f"{n}.bias"].detach() for n in names])

    def _float32(self, name: str) -> torch.Tensor:
        """The float32 matrix ``name`` (read from the file when it was deferred)."""
        if name in self.deferred:
            return dequantize(self.raw[name])
        return self.state[name]

    # --- ModelParts -----------------------------------------------------------------------------

    def fused(self, name: str, parts: Sequence[tuple[str, int]], in_features: int, bias: bool) -> nn.Module | None:
        if self.backend is None:
            return None
        names = [p for p, _ in parts]
        weights = [self._weight(p) for p in names]
        if all(w is not None for w in weights) and len({w.qtype for w in weights}) == 1:  # type: ignore[union-attr]
            self.consumed.update(f"{p}.weight" for p in names)
            self.num_quantized += len(names)
            return self._module(concat(weights), self._bias(names, bias), len(names))  # type: ignore[arg-type]
        self._pending.update(zip(names, weights))  # each part on its own type's path (``linear``)
        return None

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        if self.backend is None:
            return super().linear(name, in_features, out_features, bias)
        weight = self._pending.pop(name) if name in self._pending else self._weight(name)
        if weight is None:
            self.num_kept += 1
            return super().linear(name, in_features, out_features, bias)
        self.consumed.add(f"{name}.weight")
        self.num_quantized += 1
        return self._module(weight, self._bias([name], bias))

    def attention(self, name: str) -> Callable[..., torch.Tensor]:
        # each query row computed on its own: a token's attention is the same in any batch or chunk
        return self.kernels.paged_attention if self.kernels is not None and self.has_blocks else super().attention(name)

    def _build_head(self, config: TextModelConfig) -> None:
        """The output head (and what the embedding can share with it), once, before the embedding is built."""
        self._head_done = True
        if not self.has_blocks:
            return
        tied = config.tie_word_embeddings
        name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        if self.backend == "native":
            tensor = self.raw.get(name)
            block = None if tensor is None else read_blocks(tensor, STORED)
            if block is None:
                return
            before = self.num_torch
            self._head = self._module(block, None)
            where = " in torch" if self.num_torch > before else ""
            self.num_torch = before  # the report counts the projections only
            self._head_description = f"on GGUF blocks ({tensor.ggml_type.name}{where})"  # type: ignore[union-attr]
            if not tied:  # its float32 matrix is never read (nor, deferred, read at all)
                self.consumed.add(name)
        elif self.backend == "torch-int4":
            # the float32 table is the re-scoring reference and (tied) the embedding: held once
            self._head_table = self._float32(name).detach()
            self.consumed.add(name)

    def embedding(self, config: TextModelConfig) -> nn.Module:
        if not self._head_done:
            self._build_head(config)
        tied, name = config.tie_word_embeddings, "model.embed_tokens.weight"
        if tied and isinstance(self._head, BlockLinear):  # looked up in the head's blocks: no copy of the table
            self.consumed.add(name)
            self._embedding_blocks, self._is_embedding_in_head = self._head.qtype.name, True
            return HeadEmbedding(self._head)
        if self._head is not None:
            table = self.raw.get(name)
            rows = None if table is None else read_blocks(table, STORED)
            if rows is not None:
                self.consumed.add(name)
                self._embedding_blocks = rows.qtype.name
                with torch.device("cpu"):
                    return BlockEmbedding(rows)
        if tied and self._head_table is not None:
            with torch.device("cpu"):
                return nn.Embedding(config.vocab_size, config.hidden_size, _weight=self._head_table)
        return super().embedding(config)

    def lm_head(self, config: TextModelConfig) -> nn.Module | None:
        if config.tie_word_embeddings or self._head is not None:
            return None
        if self._head_table is not None:
            with torch.device("cpu"):
                head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            head.weight = nn.Parameter(self._head_table, requires_grad=False)
            return head
        return super().lm_head(config)

    def head(self, config: TextModelConfig, embedding: nn.Module, lm_head: nn.Module | None) -> nn.Module | None:
        if self._head_table is not None:
            with torch.device("cpu"):
                rescored = quant_torch.RescoredHead(self._head_table)
            self._head_description = f"4-bit with the top {rescored.num_rescored} re-scored in float32"
            return rescored
        return self._head

    def experts(self, name: str, config: TextModelConfig) -> nn.Module:
        if self.backend is None or self._expert_types(name) is None:
            self.num_kept += 3 if self.backend is not None else 0
            return super().experts(name, config)
        # one expert's rows off the map at a time, each read once into its run layout
        tensors = [self.raw[f"{name}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")]
        gate, up, down = map(iter_expert_blocks, tensors)
        self.consumed.update((f"{name}.gate_up_proj", f"{name}.down_proj"))
        self.num_quantized += 3
        gate_up = [self._module(self._native_form(concat([g, u])), None) for g, u in zip(gate, up)]
        experts = ExpertModules(gate_up, [self._module(self._native_form(d), None) for d in down])
        for tensor in tensors:
            tensor.release()
        return experts

    def layer_stack(self, layers: nn.ModuleList, config: TextModelConfig) -> LayerStack:
        if self.stack_choice == "auto" and self.kernels is not None and fits_native_decoder(layers, config):
            return NativeDecoder(layers, config, self.kernels, prompt_activations=self.prompt_activations)
        return super().layer_stack(layers, config)

    @property
    def report(self) -> QuantizationReport:
        """What the parts put where (complete once the model is built)."""
        if self.backend is None:
            return QuantizationReport(None, 0, 0, "float32")
        return QuantizationReport(self.backend, self.num_quantized, self.num_kept, self._head_description,
                                  "bfloat16" if self.backend == "torch-int4" else self.activations, self.num_torch,
                                  self._embedding_blocks, self._is_embedding_in_head)
