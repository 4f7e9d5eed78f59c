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

Memory: the file is mapped once (``memory.MappedFile``); ``read_gguf(defer_quantized=True)``
dequantizes none of the matrices a quantized deployment multiplies in blocks (every routed
expert's included): they stay in the map until ``quant.parts`` reads each into its block layout,
once, and its pages are dropped. It first refuses a model that cannot fit (``memory.check_fits``:
the tensors as they will run, ``run_bytes``, plus a stated overhead).
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
from ifb_plugins.common.loading.memory import MappedFile, check_fits

#: ``general.architecture`` values this loader understands.
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
#: architectures of today's families that this loader does not read, and what does
_READ_ELSEWHERE = {
    "gemma4": "Gemma 4 GGUF files are not read yet (neither their tensors nor their SentencePiece-style "
              "tokenizer.ggml.model 'gemma4'); serve the Hugging Face directory",
    "qwen35": "serve Qwen3.5 files with the mamba plugin", "qwen35moe": "serve Qwen3.5 files with the mamba plugin",
    "nemotron_h": "serve it with the mamba plugin", "nemotron_h_moe": "serve it with the mamba plugin",
    "granitehybrid": "serve it with the mamba plugin",
}
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
    ``source`` (the file's map), ``offset`` and ``nbytes`` say where the data lies in the file.
    """

    gguf_name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray = attrs.field(eq=False)
    source: MappedFile | None = attrs.field(default=None, eq=False, repr=False)
    offset: int = 0
    nbytes: int = 0

    def release(self) -> None:
        """The data was read into its run layout: count it on the load's progress and drop its pages."""
        if self.source is not None:
            self.source.release(self.offset, self.nbytes)


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
        where = f": {_READ_ELSEWHERE[arch]}" if arch in _READ_ELSEWHERE else ""
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported here (supported: "
                         f"{', '.join(GGUF_ARCHS)}){where}")

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
    reader: gguf.GGUFReader, meta: dict[str, Any], path: str | Path
) -> tuple[TextModelConfig, dict[str, GGUFTensor]]:
    names = {t.name for t in reader.tensors}
    mapped = MappedFile(Path(path), reader.data, sum(int(t.n_bytes) for t in reader.tensors))
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
        out[name] = GGUFTensor(gguf_name=t.name, ggml_type=t.tensor_type, shape=shape, data=data, source=mapped,
                               offset=int(t.data_offset), nbytes=int(t.n_bytes))
    if rope_freqs is not None:
        # llama3-style scaling is baked by the converter into per-frequency divisors.
        factors = tuple(rope_freqs.tolist())
        config = attrs.evolve(config, rope_scaling={"rope_type": "freq_factors", "factors": factors})
    return config, out


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def deferred_names(tensors: dict[str, GGUFTensor]) -> list[str]:
    """The names ``load_gguf(defer_quantized=True)`` leaves unread: quantized 2-D projections and
    embeddings, and the stacked experts of a layer whose gate, up and down are all quantized (as
    the state dict names them: ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``)."""
    out = [name for name, t in tensors.items()
           if t.ggml_type not in _FLOAT_TYPES and len(t.shape) == 2 and _DEFERRABLE.fullmatch(name)]
    for name in tensors:
        if name.endswith(".mlp.experts.gate_proj.weight"):
            stem = name.removesuffix(".gate_proj.weight")
            parts = [tensors.get(f"{stem}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
            if all(p is not None and p.ggml_type not in _FLOAT_TYPES for p in parts):
                out += [f"{stem}.gate_up_proj", f"{stem}.down_proj"]
    return out


#: bytes per 32 weights of each block type as the native kernels run it (``quant.kernels.kind_row_bytes``:
#: Q5_0 and MXFP4 as Q8_0 blocks, Q5_K and Q5_1 as float32 scales and byte codes)
RUN_BYTES_PER_32 = {
    gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20, gguf.GGMLQuantizationType.Q8_0: 34,
    gguf.GGMLQuantizationType.Q5_0: 34, gguf.GGMLQuantizationType.MXFP4: 34, gguf.GGMLQuantizationType.Q5_1: 40,
    gguf.GGMLQuantizationType.Q4_K: 18.5, gguf.GGMLQuantizationType.Q5_K: 40, gguf.GGMLQuantizationType.Q6_K: 26.25,
}


def run_bytes(tensor: GGUFTensor, deferred: bool) -> int:
    """The bytes ``tensor`` takes as the model runs: its blocks' run layout when it is deferred and
    the kernels multiply its type, else float32 (a stacked expert tensor padded per expert, as each
    expert's output columns go in groups of 16)."""
    numel = int(np.prod(tensor.shape))
    if not deferred or tensor.ggml_type not in RUN_BYTES_PER_32:
        return 4 * numel
    *lead, n, k = tensor.shape
    experts = int(np.prod(lead)) if lead else 1
    return int(experts * -(-n // 16) * 16 * k // 32 * RUN_BYTES_PER_32[tensor.ggml_type])


def materialize(model: torch.nn.Module, path: str | Path, names: Iterable[str]) -> int:
    """Fill the deferred tensors ``model`` still holds (by state-dict name) from the file, in float32;
    returns how many. A deferred matrix that went onto blocks is no longer in the state dict."""
    wanted = set(names) & set(model.state_dict(keep_vars=True))
    if not wanted:
        return 0
    tensors = read_gguf_tensors(path)
    for name in sorted(wanted):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        values = _read_float32(tensors, name)
        if isinstance(getattr(module, leaf), torch.nn.Parameter):
            setattr(module, leaf, torch.nn.Parameter(values, requires_grad=False))
        else:
            module.register_buffer(leaf, values)
    return len(wanted)


def _read_float32(tensors: dict[str, GGUFTensor], name: str) -> torch.Tensor:
    """State-dict tensor ``name`` dequantized from ``tensors`` (stacked experts fused as ``SparseMoE``
    holds them: gate rows, then up)."""
    if name.endswith(".mlp.experts.gate_up_proj"):
        stem = name.removesuffix(".gate_up_proj")
        return torch.cat([_read_float32(tensors, f"{stem}.{p}.weight") for p in ("gate_proj", "up_proj")], dim=1)
    if name.endswith(".mlp.experts.down_proj"):
        name += ".weight"
    tensor = tensors[name]
    values = dequantize(tensor)
    tensor.release()
    return values


def read_gguf_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """The file's tensors, still quantized, keyed by HF name (Q/K rows un-permuted)."""
    reader = gguf.GGUFReader(str(path))
    return _tensors_and_config(reader, read_metadata(reader), path)[1]


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor of its logical shape."""
    values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.ggml_type), dtype=np.float32)
    if not values.flags.writeable:  # float32 tensors come back as views of the read-only mmap
        values = values.copy()
    return torch.from_numpy(values.reshape(tensor.shape))


#: the matrices ``load_gguf(defer_quantized=True)`` leaves unread: those a quantized deployment
#: multiplies (or looks up) in their blocks
_DEFERRABLE = re.compile(r"model\.embed_tokens\.weight|lm_head\.weight|"
                         r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(gate|up|down)_proj)\.weight")


def load_gguf(path: str | Path, *, defer_quantized: bool = False
              ) -> tuple[TextModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Read a GGUF file: ``(config, float32 HF-named state dict, metadata)``.

    The metadata dict holds every GGUF key (``tokenizer.ggml.*``,
    ``tokenizer.chat_template``, ...) for ``TextTokenizer.from_gguf_metadata``.

    ``defer_quantized``: the quantized projection matrices, the embedding and the stacked experts come
    back as ``placeholder``s of their shape (no memory): a deployment that moves them onto block
    matmuls never holds their float32 copies; ``deferred_names`` lists
    them, and ``materialize`` fills those it still needs in float32.
    """
    config, state_dict, meta, _ = read_gguf(path, defer_quantized=defer_quantized)
    return config, state_dict, meta


def read_gguf(path: str | Path, *, defer_quantized: bool = False
              ) -> tuple[TextModelConfig, dict[str, torch.Tensor], dict[str, Any], frozenset[str]]:
    """``load_gguf``, and the names it left unread (empty without ``defer_quantized``)."""
    return read_gguf_mapped(path, defer_quantized=defer_quantized)[:4]  # type: ignore[return-value]


def read_gguf_mapped(path: str | Path, *, defer_quantized: bool = False) -> tuple[
        TextModelConfig, dict[str, torch.Tensor], dict[str, Any], frozenset[str], dict[str, GGUFTensor]]:
    """``read_gguf``, and the file's tensors as stored (``read_gguf_tensors``, over the same map:
    the tensors read here and by ``quant.parts`` count on one progress bar).

    Raises ``memory.InsufficientMemory`` before reading any tensor when the model cannot fit."""
    path = Path(path)
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    config, tensors = _tensors_and_config(reader, meta, path)
    defer = frozenset(deferred_names(tensors) if defer_quantized else ())

    def is_deferred(name: str) -> bool:
        return name in defer or _stacked_name(name) in defer

    check_fits(path, path.stat().st_size, sum(run_bytes(t, is_deferred(n)) for n, t in tensors.items()))
    state_dict = {}
    for name, t in tensors.items():
        if is_deferred(name):
            # no memory at all: the parts read these tensors' blocks instead
            stacked = _stacked_name(name)
            if stacked.endswith(".gate_up_proj"):
                if name.endswith(".gate_proj.weight"):
                    e, n, k = t.shape
                    state_dict[stacked] = placeholder((e, 2 * n, k))
            elif stacked:
                state_dict[stacked] = placeholder(t.shape)
            else:
                state_dict[name] = placeholder(t.shape)
        else:
            state_dict[name] = dequantize(t)
            t.release()
    if config.num_experts:
        state_dict = fuse_expert_state(state_dict)
    return config, state_dict, meta, defer, tensors


def placeholder(shape: tuple[int, ...]) -> torch.Tensor:
    """A deferred tensor's stand-in: ``shape`` float32 zeros over one element (no memory, not even
    reserved: a file far larger than memory loads as long as its blocks fit); ``materialize``
    replaces it, never writes into it."""
    return torch.zeros((), dtype=torch.float32).expand(*shape)


def _stacked_name(name: str) -> str:
    """The fused state-dict name of a stacked expert tensor (``...mlp.experts.gate_up_proj`` for the
    gate and up parts, ``...mlp.experts.down_proj``), or "" for any other tensor."""
    for part, fused in (("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj"), ("down_proj", "down_proj")):
        if name.endswith(f".mlp.experts.{part}.weight"):
            return name.removesuffix(f"{part}.weight") + fused
    return ""
