"""Random-weight GGUFs of real models' shapes, in llama.cpp's quantization mixes, for benchmarks.

Speed does not depend on the weights' values, only on their shapes and block types, so a file
written here streams the same bytes per token as the real model quantized the same way. The
blocks are random valid bytes (float16 scales small enough to keep activations finite); the
tokenizer, when given, is copied whole from a vocabulary GGUF (llama.cpp's source tree ships one
per tokenizer family: ``models/ggml-vocab-qwen2.gguf``), so both servers tokenize prompts to the
same ids as the real model would.

The mixes follow llama.cpp's ``llama-quantize`` choices:

- ``Q4_K_M``: Q4_K everywhere, but Q6_K for ``attn_v`` and ``ffn_down`` in the layers that get
  more bits (the first and last eighth, and every third one between) and for the output head (the
  tied embedding when there is no separate head); a matrix whose input width is not a multiple of
  256 takes llama.cpp's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0);
- ``Q5_K_M``: the same with Q5_K in place of Q4_K (fallback Q5_1);
- ``Q8_0``: every matrix in Q8_0.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

#: llama.cpp's types for a K-quant matrix whose input width is not whole 256-weight super-blocks
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
#: byte offsets of each type's float16 scales (and minima) inside a block
SCALE_OFFSETS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2],
                 Q.Q5_K: [0, 2], Q.Q6_K: [208]}
MIXES = ("Q4_K_M", "Q5_K_M", "Q8_0")
#: the type of the matrices a K-quant mix does not give more bits
BASE_TYPES = {"Q4_K_M": Q.Q4_K, "Q5_K_M": Q.Q5_K}


@attrs.frozen
class Shape:
    """A Llama-family decoder's shape (``arch`` as GGUF names it)."""

    name: str
    arch: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    rope_theta: float = 1e6
    has_qkv_bias: bool = True
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


#: Qwen2.5's published shapes (config.json of Qwen2.5-0.5B, -1.5B and -3B)
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2.5-0.5b", "qwen2", 24, 896, 4864, 14, 2, 151936),
    "qwen2.5-1.5b": Shape("qwen2.5-1.5b", "qwen2", 28, 1536, 8960, 12, 2, 151936),
    "qwen2.5-3b": Shape("qwen2.5-3b", "qwen2", 36, 2048, 11008, 16, 2, 151936),
}


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers Q4_K_M gives Q6_K for ``attn_v`` and ``ffn_down``."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def matrix_type(mix: str, role: str, layer: int, num_layers: int, in_features: int) -> Q:
    """The block type ``mix`` gives one matrix (``role``: attn_q, ..., ffn_down, output)."""
    if mix == "Q8_0":
        return Q.Q8_0
    if mix not in BASE_TYPES:
        raise ValueError(f"unknown mix {mix!r}; choose from {', '.join(MIXES)}")
    if role == "output" or (role in ("attn_v", "ffn_down") and more_bits(layer, num_layers)):
        qtype = Q.Q6_K
    else:
        qtype = BASE_TYPES[mix]
    return FALLBACK[qtype] if in_features % 256 else qtype


def random_rows(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` rows of ``k`` weights as valid random blocks: random bytes, small float16 scales."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // weights, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        raw[..., offset:offset + 2] = np.full((n, k // weights, 1), 2e-4, np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab: Path) -> int:
    """Every ``tokenizer.*`` field of ``vocab`` into ``writer``; returns the vocabulary size."""
    reader = gguf.GGUFReader(str(vocab))
    size = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            values = [_value(field, i, sub) for i in field.data]
            writer.add_array(key, values)
            if key == "tokenizer.ggml.tokens":
                size = len(values)
        else:
            writer.add_key_value(key, _value(field, field.data[0], kind), kind)
    return size


def _value(field: gguf.ReaderField, index: int, kind: gguf.GGUFValueType) -> object:
    part = field.parts[index]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def write_gguf(path: Path, shape: Shape, mix: str, *, vocab: Path | None = None, context_length: int = 4096,
               seed: int = 0) -> dict[str, int]:
    """Write the file; returns how many matrices of each block type it holds."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"{shape.name} random weights ({mix})")
    w.add_block_count(shape.num_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{mix}"])
    if vocab is not None:
        size = _copy_tokenizer(w, vocab)
        if size != shape.vocab:
            raise ValueError(f"{vocab.name} has {size} tokens; {shape.name} has {shape.vocab}")
    else:
        w.add_vocab_size(shape.vocab)
    counts: dict[str, int] = {}

    def add(name: str, qtype: Q, n: int, k: int) -> None:
        w.add_tensor(name, random_rows(qtype, n, k, rng), raw_dtype=qtype)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1

    h, kv = shape.hidden, shape.head_dim * shape.num_kv_heads
    dims = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
            "ffn_gate": (shape.intermediate, h), "ffn_up": (shape.intermediate, h),
            "ffn_down": (h, shape.intermediate)}
    embed_type = matrix_type(mix, "output" if shape.tied else "token_embd", 0, shape.num_layers, h)
    add("token_embd.weight", embed_type, shape.vocab, h)
    if not shape.tied:
        add("output.weight", matrix_type(mix, "output", 0, shape.num_layers, h), shape.vocab, h)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(shape.num_layers):
        for role, (n, k) in dims.items():
            add(f"blk.{i}.{role}.weight", matrix_type(mix, role, i, shape.num_layers, k), n, k)
        if shape.has_qkv_bias:
            for role, size in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(f"blk.{i}.{role}.bias", (rng.standard_normal(size) * 0.01).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF: what one decode step streams when the embedding is the head
    (tied) or counted as such (a lookup reads one row, the separate head reads all)."""
    reader = gguf.GGUFReader(str(path))
    total = sum(int(t.n_bytes) for t in reader.tensors)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    if has_output:  # the embedding is only looked up
        total -= sum(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    return total


@attrs.frozen
class MoeShape:
    """A Qwen-family mixture of experts' shape (``arch``: ``qwen2moe`` or ``qwen3moe``).

    ``shared_intermediate``: Qwen2-MoE's gated shared expert (0: none); ``qwen3moe`` files carry
    per-head Q/K norms."""

    name: str
    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    vocab: int
    vocab_file: str = "qwen2"
    shared_intermediate: int = 0
    rope_theta: float = 1e6
    has_qkv_bias: bool = False


#: published shapes (each model's config.json). OLMoE-1B-7B is written as ``qwen3moe`` (ifb and
#: llama.cpp both run it; OLMoE's own Q/K norms span all heads, a few thousand weights a layer
#: more): the same matrices, experts and routing width, so the same bytes a token streams; its
#: vocabulary is llama.cpp's GPT-NeoX file (50,432 tokens; OLMoE pads the same tokenizer to 50,304).
MOE_SHAPES = {
    "olmoe-1b-7b": MoeShape("olmoe-1b-7b", "qwen3moe", 16, 2048, 16, 16, 128, 64, 8, 1024, 50432,
                            vocab_file="gpt-neox", rope_theta=10000.0),
    "qwen1.5-moe-a2.7b": MoeShape("qwen1.5-moe-a2.7b", "qwen2moe", 24, 2048, 16, 16, 128, 60, 4, 1408,
                                  151936, shared_intermediate=5632, has_qkv_bias=True),
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", "qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936),
}


def _random_block_bytes(qtype: Q, lead: tuple[int, ...], k: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of shape ``lead + (k // weights_per_block * block_bytes,)``."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = int(np.prod(lead)) * (k // weights)
    raw = np.frombuffer(rng.bytes(blocks * nbytes), np.uint8).reshape(blocks, nbytes).copy()
    for offset in SCALE_OFFSETS[qtype]:
        raw[:, offset:offset + 2] = np.full((blocks, 1), 2e-4, np.float16).view(np.uint8)
    return raw.reshape(*lead, -1)


def write_moe_gguf(path: Path, shape: MoeShape, mix: str, *, vocab: Path | None = None,
                   context_length: int = 4096, seed: int = 0) -> dict[str, int]:
    """Write a mixture of experts in ``mix``, streaming one tensor at a time (the largest file is
    bigger than this machine's memory would spare); returns the matrices of each block type.

    llama.cpp's ``Q4_K_M`` for experts: ``ffn_down_exps`` and the shared expert's down take Q6_K
    in the layers ``more_bits`` names (the layer read from the tensor's name), as ``attn_v`` does;
    the router (``ffn_gate_inp``) and the shared expert's gate vector stay float32; the embedding
    keeps the base type and the separate head is Q6_K."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"{shape.name} random weights ({mix})")
    w.add_block_count(shape.num_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.expert_intermediate)
    w.add_expert_feed_forward_length(shape.expert_intermediate)
    if shape.shared_intermediate:
        w.add_expert_shared_feed_forward_length(shape.shared_intermediate)
    w.add_expert_count(shape.num_experts)
    w.add_expert_used_count(shape.top_k)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{mix}"])
    if vocab is not None:
        size = _copy_tokenizer(w, vocab)
        if size != shape.vocab:
            raise ValueError(f"{vocab.name} has {size} tokens; {shape.name} has {shape.vocab}")
    else:
        w.add_vocab_size(shape.vocab)
    counts: dict[str, int] = {}
    plan: list[tuple[str, Q | None, tuple[int, ...], int]] = []  # name, type (None: float32), lead dims, k

    def matrix(name: str, role: str, layer: int, lead: tuple[int, ...], k: int) -> None:
        qtype = matrix_type(mix, role, layer, shape.num_layers, k)
        plan.append((name, qtype, lead, k))
        counts[qtype.name] = counts.get(qtype.name, 0) + 1

    def vector(name: str, lead: tuple[int, ...], k: int) -> None:
        plan.append((name, None, lead, k))

    h, q, kv, e, i = (shape.hidden, shape.head_dim * shape.num_heads, shape.head_dim * shape.num_kv_heads,
                      shape.num_experts, shape.expert_intermediate)
    matrix("token_embd.weight", "token_embd", 0, (shape.vocab,), h)
    matrix("output.weight", "output", 0, (shape.vocab,), h)
    vector("output_norm.weight", (), h)
    for layer in range(shape.num_layers):
        blk = f"blk.{layer}"
        for role, n, k in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            matrix(f"{blk}.{role}.weight", role, layer, (n,), k)
        if shape.has_qkv_bias:
            for role, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                vector(f"{blk}.{role}.bias", (), n)
        if shape.arch == "qwen3moe":
            vector(f"{blk}.attn_q_norm.weight", (), shape.head_dim)
            vector(f"{blk}.attn_k_norm.weight", (), shape.head_dim)
        vector(f"{blk}.attn_norm.weight", (), h)
        vector(f"{blk}.ffn_norm.weight", (), h)
        vector(f"{blk}.ffn_gate_inp.weight", (e,), h)
        matrix(f"{blk}.ffn_gate_exps.weight", "ffn_gate", layer, (e, i), h)
        matrix(f"{blk}.ffn_up_exps.weight", "ffn_up", layer, (e, i), h)
        matrix(f"{blk}.ffn_down_exps.weight", "ffn_down", layer, (e, h), i)
        if shape.shared_intermediate:
            s = shape.shared_intermediate
            vector(f"{blk}.ffn_gate_inp_shexp.weight", (), h)
            matrix(f"{blk}.ffn_gate_shexp.weight", "ffn_gate", layer, (s,), h)
            matrix(f"{blk}.ffn_up_shexp.weight", "ffn_up", layer, (s,), h)
            matrix(f"{blk}.ffn_down_shexp.weight", "ffn_down", layer, (h,), s)

    def data(name: str, qtype: Q | None, lead: tuple[int, ...], k: int) -> np.ndarray:
        if qtype is not None:
            return _random_block_bytes(qtype, lead, k, rng)
        if name.endswith("norm.weight"):
            return np.ones((*lead, k), np.float32)
        # biases, the router and the shared expert's gate: small, so routing and activations stay finite
        return (rng.standard_normal((*lead, k)) * 0.02).astype(np.float32)

    for name, qtype, lead, k in plan:
        if qtype is None:
            w.add_tensor_info(name, (*lead, k), np.dtype(np.float32), 4 * int(np.prod((*lead, k))))
        else:
            weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor_info(name, (*lead, k // weights * nbytes), np.dtype(np.uint8),
                              int(np.prod(lead)) * (k // weights) * nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, qtype, lead, k in plan:
        w.write_tensor_data(data(name, qtype, lead, k))
    w.close()
    return counts


def active_tensor_bytes(path: Path) -> int:
    """Bytes one batch-1 decode step streams: ``tensor_bytes``, but of each stacked expert tensor
    (``*_exps``) only the share of the experts a token picks (``expert_used_count`` of
    ``expert_count``); the router and shared experts count whole."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    fields = {name: field.contents() for name, field in reader.fields.items()}
    num_experts = int(fields.get(f"{arch}.expert_count") or 0)
    if not num_experts:
        return tensor_bytes(path)
    top_k = int(fields[f"{arch}.expert_used_count"])
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and any(u.name == "output.weight" for u in reader.tensors):
            continue
        total += int(t.n_bytes) * (top_k / num_experts if "_exps." in t.name else 1)
    return int(total)
