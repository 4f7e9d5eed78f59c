"""Load a llama.cpp GGUF file into a ``TextModelConfig`` and an HF-named float32 state dict.

llama.cpp's converter reorders the rows of the Q and K projections of Llama
models so that its interleaved RoPE (pairs ``2i, 2i+1``) matches HF's
rotate-half RoPE (pairs ``i, i + D/2``). Our model uses rotate-half, so those
rows are put back. Qwen2/Qwen3 GGUFs are written unpermuted (llama.cpp runs
them with NeoX-style RoPE) and are left as they are.

Mixtures of experts: ``qwen3moe``, ``qwen2moe``, and ``llama`` with an
``expert_count`` (Mixtral). llama.cpp stacks each layer's experts into
``ffn_{gate,up,down}_exps`` (``[E, I, H]`` / ``[E, H, I]``), the router is
``ffn_gate_inp`` and Qwen2-MoE's shared expert ``ffn_*_shexp`` with its gate
``ffn_gate_inp_shexp`` (``[H]``). The float32 state dict holds them in
``moe.SparseMoE``'s layout; ``read_gguf_tensors`` keeps them stacked and stored.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

import attrs
import gguf
import numpy as np
import torch

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.layers.moe import fuse_expert_state

#: ``general.architecture`` values this loader understands.
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
#: our arch name (config.json's ``model_type``) per GGUF architecture with experts
_MOE_ARCH = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
#: whether llama.cpp renormalizes the top-k weights of each arch when the file does not say
#: (``expert_weights_norm``): its qwen3moe and llama graphs do, its qwen2moe graph does not
_NORM_TOPK_DEFAULT = {"llama": True, "qwen3moe": True, "qwen2moe": False}

# GGUF tensor name -> HF name; ``{}`` is the layer index.
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@attrs.frozen
class GGUFTensor:
    """One tensor as stored: its ggml type, logical shape (torch order) and raw rows.

    ``data`` is the file's array (memory-mapped, one row per output feature for
    matrices, so quantized blocks stay intact); Q/K rows are already un-permuted.
    """

    gguf_name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray = attrs.field(eq=False)


def hf_name(gguf_name: str) -> str | None:
    """The HF state-dict name of a GGUF tensor, or None for tensors we do not load."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields of the file as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: within each head, rows ``(pair, half)`` -> ``(half, pair)``."""
    head_rows = rows.shape[0] // n_head
    rest = rows.shape[1:]
    return rows.reshape(n_head, head_rows // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


def _config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> TextModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    rope_scaling: dict[str, Any] | None = None
    if key("rope.scaling.type") == "linear" and float(key("rope.scaling.factor", 1.0)) != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif key("rope.scaling.type") not in (None, "none", "linear"):
        raise NotImplementedError(f"GGUF RoPE scaling {key('rope.scaling.type')!r} is not supported")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    moe = _moe_fields(arch, key, tensor_names, int(key("block_count")))
    return TextModelConfig(
        arch=_MOE_ARCH[arch] if moe else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        max_position_embeddings=int(key("context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        sliding_window=key("attention.sliding_window"),
        **moe,
    )


def _moe_fields(arch: str, key: Any, tensor_names: set[str], num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of the config (none for a dense file)."""
    num_experts = int(key("expert_count") or 0)
    if not num_experts:
        return {}
    if arch not in _MOE_ARCH:
        raise ValueError(f"GGUF architecture {arch!r} with experts is not supported")
    gating = key("expert_gating_func")
    if gating not in (None, gguf.ExpertGatingFuncType.SOFTMAX):
        raise NotImplementedError(f"GGUF expert gating function {gating} is not supported (softmax only)")
    # Layers without a router keep a dense MLP.
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length") or key("feed_forward_length")),
        "norm_topk_prob": bool(key("expert_weights_norm", _NORM_TOPK_DEFAULT[arch])),
        "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length") or 0),
        "mlp_only_layers": dense,
    }


def _tensors_and_config(
    reader: gguf.GGUFReader, meta: dict[str, Any]
) -> tuple[TextModelConfig, dict[str, GGUFTensor]]:
    names = {t.name for t in reader.tensors}
    config = _config_from_metadata(meta, names)
    permuted = meta.get("general.architecture") == "llama"
    out: dict[str, GGUFTensor] = {}
    rope_freqs = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            rope_freqs = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            continue
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file")
        data = t.data
        if permuted and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            data = _unpermute_rows(data, heads)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (the fastest dim) first
        if name.endswith(".shared_expert_gate.weight"):
            shape = (1, *shape)  # llama.cpp squeezes the [1, H] gate to [H]
        out[name] = GGUFTensor(gguf_name=t.name, ggml_type=t.tensor_type, shape=shape, data=data)
    if rope_freqs is not None:
        # llama3-style scaling is baked by the converter into per-frequency divisors.
        factors = tuple(rope_freqs.tolist())
        config = attrs.evolve(config, rope_scaling={"rope_type": "freq_factors", "factors": factors})
    return config, out


def deferred_names(tensors: dict[str, GGUFTensor]) -> list[str]:
    """The names ``load_gguf(defer_quantized=True)`` leaves unread: quantized 2-D projections and
    embeddings of a dense model (a mixture of experts is read whole, as before)."""
    if any(".experts." in name for name in tensors):
        return []
    dense = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    return [name for name, t in tensors.items()
            if t.ggml_type not in dense and len(t.shape) == 2 and _DEFERRABLE.fullmatch(name)]


def materialize(model: torch.nn.Module, path: str | Path, names: Iterable[str]) -> int:
    """Fill the deferred tensors ``model`` still holds (by state-dict name) from the file, in float32;
    returns how many. A deferred matrix that went onto blocks is no longer in the state dict."""
    wanted = set(names) & set(model.state_dict(keep_vars=True))
    if not wanted:
        return 0
    tensors = read_gguf_tensors(path)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in sorted(wanted):
            state[name].copy_(dequantize(tensors[name]))
    return len(wanted)


def read_gguf_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """The file's tensors, still quantized, keyed by HF name (Q/K rows un-permuted)."""
    reader = gguf.GGUFReader(str(path))
    return _tensors_and_config(reader, read_metadata(reader))[1]


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor of its logical shape."""
    values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.ggml_type), dtype=np.float32)
    if not values.flags.writeable:  # float32 tensors come back as views of the read-only mmap
        values = values.copy()
    return torch.from_numpy(values.reshape(tensor.shape))


#: the matrices ``load_gguf(defer_quantized=True)`` leaves unread: those a quantized deployment
#: multiplies (or looks up) in their blocks
_DEFERRABLE = re.compile(r"model\.embed_tokens\.weight|lm_head\.weight|"
                         r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def load_gguf(path: str | Path, *, defer_quantized: bool = False
              ) -> tuple[TextModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Read a GGUF file: ``(config, float32 HF-named state dict, metadata)``.

    The metadata dict holds every GGUF key (``tokenizer.ggml.*``,
    ``tokenizer.chat_template``, ...) for ``TextTokenizer.from_gguf_metadata``.

    ``defer_quantized``: the quantized projection matrices and the embedding of a dense model come
    back as uninitialised tensors of their shape (memory is reserved, never touched): a deployment
    that moves them onto block matmuls never holds their float32 copies; ``deferred_names`` lists
    them, and ``materialize`` fills those it still needs in float32.
    """
    config, state_dict, meta, _ = read_gguf(path, defer_quantized=defer_quantized)
    return config, state_dict, meta


def read_gguf(path: str | Path, *, defer_quantized: bool = False
              ) -> tuple[TextModelConfig, dict[str, torch.Tensor], dict[str, Any], frozenset[str]]:
    """``load_gguf``, and the names it left unread (empty without ``defer_quantized``)."""
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    config, tensors = _tensors_and_config(reader, meta)
    defer = frozenset(deferred_names(tensors) if defer_quantized else ())
    state_dict = {name: torch.empty(t.shape) if name in defer else dequantize(t) for name, t in tensors.items()}
    if config.num_experts:
        state_dict = fuse_expert_state(state_dict)
    return config, state_dict, meta, defer
