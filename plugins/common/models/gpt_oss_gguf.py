"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture) onto ``GptOssModel``.

llama.cpp's converter splits transformers' fused, interleaved ``gate_up_proj`` into
``ffn_{gate,up}_exps`` (with biases) and writes every expert matrix ``[E, out, in]``; the layers
alternate sliding and full attention, sliding first, as llama.cpp runs them; the clamped SwiGLU's
``alpha`` and ``limit`` are fixed in llama.cpp's graph, not in the file (1.702 and 7.0).

The released files keep their experts in MXFP4 (llama.cpp writes MXFP4 only from an MXFP4
checkpoint). Routed experts whose tensors are MXFP4, Q8_0, Q4_0 or Q4_1 are multiplied on their
blocks by the native kernels (``BlockExperts``; MXFP4 rewritten exactly as Q8_0 blocks,
``quant.linear.mxfp4_as_q8_0``) when ``read_gpt_oss_gguf`` is given the kernels' activations; every
other tensor (attention, router, embedding, head, norms, biases) is dequantized to float32, as is
every tensor when it is not (``quantization none``, a device other than the CPU, no kernels).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import torch
from torch import nn

from ifb_plugins.common.loading.gguf import read_metadata
from ifb_plugins.common.models.gpt_oss import FULL, SLIDING, GptOssConfig, GptOssConfigError
from ifb_plugins.common.quant import kernels as qkernels
from ifb_plugins.common.quant.linear import BlockLinear, BlockWeight, concat, native_form

log = logging.getLogger("ifb.text")
Q = gguf.GGMLQuantizationType
#: tensor types read as float32
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
#: expert tensor types multiplied on their blocks (MXFP4 as Q8_0 blocks); other tensors of these
#: types, and experts of other block types, are dequantized
EXPERT_BLOCK_TYPES = (Q.MXFP4, Q.Q8_0, Q.Q4_0, Q.Q4_1)
#: the harmony markers that end an assistant turn
HARMONY_ENDS = ("<|return|>", "<|call|>")
#: block types read at all (dequantized where not on blocks)
READ_TYPES = (*FLOAT_TYPES, *EXPERT_BLOCK_TYPES)


class BlockExperts(nn.Module):
    """gpt-oss's routed experts on GGUF blocks: per expert, gate and up rows in one block matmul (gate
    rows first) with their biases, then the clamped SwiGLU and the down projection, as ``gpt_oss.Experts``."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], alpha: float, limit: float) -> None:
        super().__init__()
        self.num_experts = len(down)
        self.alpha, self.limit = alpha, limit
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    def forward(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        gate, up = self.gate_up[expert_id](x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down[expert_id]((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


@attrs.frozen
class GptOssFile:
    """What ``read_gpt_oss_gguf`` read: the config, the float32 state dict under ``GptOssModel``'s names
    (without the experts on blocks), each layer's ``BlockExperts`` (or None: all float32), the metadata."""

    config: GptOssConfig
    state: dict[str, torch.Tensor]
    experts: list[BlockExperts] | None
    metadata: dict[str, Any]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[..., I]`` gate and up columns -> ``[..., 2I]`` alternating (transformers' fused layout)."""
    return torch.stack((gate, up), dim=-1).flatten(-2)


def _float(t: Any) -> torch.Tensor:
    values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return torch.from_numpy(values.copy().reshape([int(d) for d in reversed(t.shape)]))


def _expert_blocks(t: Any) -> list[BlockWeight]:
    """A stacked ``[E, N, K]`` expert tensor as one ``BlockWeight`` per expert (rows as stored)."""
    e, n, k = (int(d) for d in reversed(t.shape))
    data = np.ascontiguousarray(t.data).reshape(e, n, -1)
    return [BlockWeight(t.tensor_type, torch.from_numpy(data[i].copy()), k) for i in range(e)]


def _config(meta: dict[str, Any], vocab_size: int, has_output: bool) -> GptOssConfig:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"gpt-oss.{name}", default)
        if value is None:
            raise GptOssConfigError(f"GGUF metadata gpt-oss.{name} is missing")
        return value

    num_layers = int(key("block_count"))
    rope: dict[str, Any] = {"rope_type": "default"}
    scaling = meta.get("gpt-oss.rope.scaling.type")
    if scaling == "yarn":
        # the converter does not write YaRN's truncate flag; gpt-oss's own configs set it false
        rope = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    elif scaling not in (None, "none"):
        raise GptOssConfigError(f"GGUF metadata gpt-oss.rope.scaling.type {scaling!r} is not supported "
                                "(none or yarn)")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    eos = [meta["tokenizer.ggml.eos_token_id"]] if meta.get("tokenizer.ggml.eos_token_id") is not None else []
    # the harmony format's turn ends, which llama.cpp also takes for ends of generation: the file
    # names one end of sequence, the released generation config two (<|return|>, <|call|>)
    eos += [tokens.index(t) for t in HARMONY_ENDS if t in tokens]
    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=int(key("embedding_length")),
        num_heads=int(key("attention.head_count")), num_kv_heads=int(key("attention.head_count_kv")),
        head_dim=int(key("attention.key_length")),
        layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers)),
        sliding_window=int(key("attention.sliding_window")), num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")), intermediate_size=int(key("expert_feed_forward_length")),
        swiglu_alpha=1.702, swiglu_limit=7.0,  # fixed in llama.cpp's gpt-oss graph, not in the file
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), rope_theta=float(key("rope.freq_base")),
        rope=tuple(sorted(rope.items())), max_position_embeddings=int(key("context_length")),
        tie_word_embeddings=not has_output, eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)))


def _block_experts(tensors: dict[str, Any], config: GptOssConfig, layer: int, kernels: qkernels.Kernels,
                   activations: qkernels.Activations) -> BlockExperts | None:
    """Layer ``layer``'s experts on blocks, or None when a part's type is not one the kernels take."""
    p = f"blk.{layer}."
    parts = [tensors[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")]
    if any(t.tensor_type not in EXPERT_BLOCK_TYPES for t in parts) or parts[0].tensor_type != parts[1].tensor_type:
        return None
    gate, up, down = (_expert_blocks(t) for t in parts)
    gate_bias, up_bias, down_bias = (_float(tensors.pop(p + f"ffn_{n}_exps.bias")) for n in ("gate", "up", "down"))
    for name in ("gate", "up", "down"):
        tensors.pop(p + f"ffn_{name}_exps.weight")

    def module(weight: BlockWeight, bias: torch.Tensor) -> BlockLinear:
        with torch.device("cpu"):
            return BlockLinear(native_form(weight, integer_activations=activations != "float32"), bias, kernels,
                               activations=activations)

    return BlockExperts([module(concat([g, u]), torch.cat([gb, ub]))
                         for g, u, gb, ub in zip(gate, up, gate_bias, up_bias)],
                        [module(d, db) for d, db in zip(down, down_bias)], config.swiglu_alpha, config.swiglu_limit)


def read_gpt_oss_gguf(path: str | Path, activations: qkernels.Activations | None = None) -> GptOssFile:
    """A ``gpt-oss`` GGUF file as llama.cpp's converter writes it; with ``activations`` (and the native
    kernels built), its block-typed experts on the kernels with those activations."""
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    if meta.get("general.architecture") != "gpt-oss":
        raise GptOssConfigError(f"GGUF general.architecture {meta.get('general.architecture')!r} is not gpt-oss")
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type not in READ_TYPES:
            raise GptOssConfigError(f"GGUF tensor {t.name} is {t.tensor_type.name}: gpt-oss files are read in "
                                    f"{', '.join(q.name for q in READ_TYPES)}")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    config = _config(meta, vocab_size, "output.weight" in tensors)
    kernels = qkernels.load() if activations is not None else None
    experts = None
    if kernels is not None:
        experts = [_block_experts(tensors, config, i, kernels, activations) for i in range(config.num_layers)]
        if any(e is None for e in experts):
            log.info("%s: experts of types the kernels do not take are dequantized to float32", path)
            experts = None  # one form for every layer; the float32 experts come from the tensors below
            tensors = {t.name: t for t in reader.tensors}
    raw = {name: _float(t) for name, t in tensors.items()}
    return GptOssFile(config, _state(raw, config, experts is not None), experts, meta)


def _state(raw: dict[str, torch.Tensor], config: GptOssConfig, has_block_experts: bool) -> dict[str, torch.Tensor]:
    """The file's float32 tensors under ``GptOssModel``'s names (the experts too unless on blocks)."""
    names = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
             "ffn_gate_inp.bias": "mlp.router.bias"}
    for proj, ours in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
        names |= {f"{proj}.weight": f"self_attn.{ours}.weight", f"{proj}.bias": f"self_attn.{ours}.bias"}
    state = {"model.embed_tokens.weight": raw.pop("token_embd.weight"),
             "model.norm.weight": raw.pop("output_norm.weight")}
    if "output.weight" in raw:
        state["lm_head.weight"] = raw.pop("output.weight")
    for i in range(config.num_layers):
        p, ours = f"blk.{i}.", f"model.layers.{i}."
        if not has_block_experts:
            experts = {n: raw.pop(p + n) for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                   "ffn_down_exps.weight", "ffn_gate_exps.bias",
                                                   "ffn_up_exps.bias", "ffn_down_exps.bias")}
            state[ours + "mlp.experts.gate_up_proj"] = _interleave(experts["ffn_gate_exps.weight"].transpose(1, 2),
                                                                   experts["ffn_up_exps.weight"].transpose(1, 2))
            state[ours + "mlp.experts.gate_up_proj_bias"] = _interleave(experts["ffn_gate_exps.bias"],
                                                                        experts["ffn_up_exps.bias"])
            state[ours + "mlp.experts.down_proj"] = experts["ffn_down_exps.weight"].transpose(1, 2)
            state[ours + "mlp.experts.down_proj_bias"] = experts["ffn_down_exps.bias"]
        for name, target in names.items():
            state[ours + target] = raw.pop(p + name)
    if raw:
        raise GptOssConfigError(f"unexpected tensor {sorted(raw)[0]!r} in the GGUF file")
    return {k: v.contiguous() for k, v in state.items()}
