"""Random-weight GGUFs of Qwen3.5 (``qwen35``) and gpt-oss (``gpt-oss``) shapes, in llama.cpp's layout.

``gguf_shapes`` writes Llama-family files; these two families lay their tensors out otherwise, and
each file here has the metadata keys and tensor names and shapes that llama.cpp's own
``convert_hf_to_gguf.py`` writes for a checkpoint of the family (Qwen3.5 converted with
``--no-mtp``), the blocks random as ``gguf_shapes.random_rows`` makes them:

- Qwen3.5 (2B class): Gated DeltaNet layers three to one with gated full attention
  (``full_attention_interval`` 4); every matrix ``Q8_0``, norms and the DeltaNet's ``A``, ``dt``
  and convolution in float32; the head tied to the embedding;
- gpt-oss (20b class): sliding and full attention alternating, learned sinks, a router with bias,
  experts in ``MXFP4`` (as the released checkpoints ship them) with float32 biases, attention and
  the embedding and head in ``Q8_0``.

The tokenizer is llama.cpp's ``ggml-vocab-qwen2.gguf`` (a byte-level BPE), padded with unused
tokens to the family's vocabulary size, so the embedding and head have the real shapes.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import numpy as np

from gguf_shapes import _value, random_rows

Q = gguf.GGMLQuantizationType


@attrs.frozen
class Qwen35Shape:
    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    vocab: int
    conv_kernel: int = 4
    full_attention_interval: int = 4
    rotary_fraction: float = 0.25


@attrs.frozen
class GptOssShape:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    sliding_window: int
    vocab: int


#: the 2B-class Qwen3.5 text model and gpt-oss-20b (24 layers; scaled down in layers with ``num_layers``)
QWEN35_2B = Qwen35Shape("qwen3.5-2b", 24, 2048, 6144, 8, 2, 256, 16, 16, 128, 128, 248320)
GPT_OSS_20B = GptOssShape("gpt-oss-20b", 24, 2880, 64, 8, 64, 32, 4, 2880, 128, 201088)


def random_mxfp4(n: int, k: int, rng: np.random.Generator, experts: int = 1) -> np.ndarray:
    """``[experts, n, k / 32 * 17]`` MXFP4 blocks: an E8M0 scale byte (2^-8) and 16 bytes of nibbles."""
    blocks = rng.integers(0, 256, size=(experts, n, k // 32, 17), dtype=np.uint8)
    blocks[..., 0] = 127 - 8
    return blocks.reshape(experts, n, -1)


def _padded_tokenizer(writer: gguf.GGUFWriter, vocab: Path, size: int) -> None:
    """Every ``tokenizer.*`` field of ``vocab``, its token list padded with unused tokens to ``size``."""
    reader = gguf.GGUFReader(str(vocab))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        kind = field.types[0]
        if kind != gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, _value(field, field.data[0], kind), kind)
            continue
        values = [_value(field, i, field.types[1]) for i in field.data]
        if key == "tokenizer.ggml.tokens":
            values += [f"<|unused_{i}|>" for i in range(size - len(values))]
        elif key == "tokenizer.ggml.token_type":
            values += [int(gguf.TokenType.UNUSED)] * (size - len(values))
        writer.add_array(key, values)


def _writer(path: Path, arch: str, name: str, vocab: Path, vocab_size: int, context: int):
    """The writer and its ``matrix`` / ``floats`` / ``raw`` adders; tensors are made as they are
    written (``_close``), one at a time, so a file larger than the free memory can be written."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{name} random weights")
    w.add_context_length(context)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _padded_tokenizer(w, vocab, vocab_size)
    rng = np.random.default_rng(0)
    w.pending = []  # (make) in the order of the tensor infos

    def raw(tensor: str, shape: tuple[int, ...], dtype: np.dtype, qtype: Q | None, make) -> None:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(tensor, shape, np.dtype(dtype), nbytes, raw_dtype=qtype)
        w.pending.append(make)

    def matrix(tensor: str, n: int, k: int, qtype: Q = Q.Q8_0) -> None:
        weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw(tensor, (n, k // weights * block_bytes), np.uint8, qtype, lambda: random_rows(qtype, n, k, rng))

    def floats(tensor: str, *shape: int, scale: float = 0.0, base: float = 1.0) -> None:
        raw(tensor, shape, np.float32, None, lambda: (base + scale * rng.standard_normal(shape)).astype(np.float32))

    return w, raw, matrix, floats


def _close(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in w.pending:
        w.write_tensor_data(make())
    w.close()


def write_qwen35(path: Path, shape: Qwen35Shape, vocab: Path, context: int = 4096) -> None:
    """A ``qwen35`` GGUF of ``shape``."""
    s = shape
    w, raw, matrix, floats = _writer(path, "qwen35", s.name, vocab, s.vocab, context)
    w.add_block_count(s.num_layers)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_rope_freq_base(1e7)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_ssm_conv_kernel(s.conv_kernel)
    w.add_ssm_state_size(s.linear_key_dim)
    w.add_ssm_group_count(s.linear_key_heads)
    w.add_ssm_time_step_rank(s.linear_value_heads)
    w.add_ssm_inner_size(s.linear_value_heads * s.linear_value_dim)
    recurrent = [(i + 1) % s.full_attention_interval != 0 for i in range(s.num_layers)]
    w.add_array("qwen35.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(s.full_attention_interval)
    w.add_rope_dimension_count(int(s.head_dim * s.rotary_fraction))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    h, value_dim = s.hidden, s.linear_value_heads * s.linear_value_dim
    conv_dim = 2 * s.linear_key_heads * s.linear_key_dim + value_dim
    matrix("token_embd.weight", s.vocab, h)
    floats("output_norm.weight", h)
    for i in range(s.num_layers):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", h)
        floats(p + "post_attention_norm.weight", h)
        if recurrent[i]:
            floats(p + "ssm_a", s.linear_value_heads, base=-1.0, scale=0.1)
            floats(p + "ssm_dt.bias", s.linear_value_heads, base=0.0, scale=0.1)
            floats(p + "ssm_conv1d.weight", conv_dim, s.conv_kernel, base=0.0, scale=0.2)
            floats(p + "ssm_norm.weight", s.linear_value_dim)
            matrix(p + "ssm_alpha.weight", s.linear_value_heads, h)
            matrix(p + "ssm_beta.weight", s.linear_value_heads, h)
            matrix(p + "attn_qkv.weight", conv_dim, h)
            matrix(p + "attn_gate.weight", value_dim, h)
            matrix(p + "ssm_out.weight", h, value_dim)
        else:
            matrix(p + "attn_q.weight", 2 * s.num_heads * s.head_dim, h)  # the queries and their gates
            matrix(p + "attn_k.weight", s.num_kv_heads * s.head_dim, h)
            matrix(p + "attn_v.weight", s.num_kv_heads * s.head_dim, h)
            matrix(p + "attn_output.weight", h, s.num_heads * s.head_dim)
            floats(p + "attn_q_norm.weight", s.head_dim)
            floats(p + "attn_k_norm.weight", s.head_dim)
        matrix(p + "ffn_gate.weight", s.intermediate, h)
        matrix(p + "ffn_up.weight", s.intermediate, h)
        matrix(p + "ffn_down.weight", h, s.intermediate)
    _close(w)


def write_gpt_oss(path: Path, shape: GptOssShape, vocab: Path, context: int = 4096) -> None:
    """A ``gpt-oss`` GGUF of ``shape``, its experts in MXFP4."""
    s = shape
    w, raw, matrix, floats = _writer(path, "gpt-oss", s.name, vocab, s.vocab, context)
    arch = "gpt-oss"
    w.add_block_count(s.num_layers)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.expert_intermediate)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", 32.0)
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", 4096)
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(s.num_experts)
    w.add_expert_used_count(s.top_k)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_sliding_window(s.sliding_window)
    w.add_expert_feed_forward_length(s.expert_intermediate)
    h, q, kv, e, i_ = s.hidden, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_experts, s.expert_intermediate
    matrix("token_embd.weight", s.vocab, h)
    matrix("output.weight", s.vocab, h)
    floats("output_norm.weight", h)
    for i in range(s.num_layers):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", h)
        floats(p + "post_attention_norm.weight", h)
        for role, n, k in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            matrix(p + role + ".weight", n, k)
            floats(p + role + ".bias", n, base=0.0, scale=0.01)
        floats(p + "attn_sinks.weight", s.num_heads, base=0.0, scale=1.0)
        floats(p + "ffn_gate_inp.weight", e, h, base=0.0, scale=0.02)
        floats(p + "ffn_gate_inp.bias", e, base=0.0, scale=0.01)
        for role, n, k in (("ffn_gate_exps", i_, h), ("ffn_up_exps", i_, h), ("ffn_down_exps", h, i_)):
            raw(p + role + ".weight", (e, n, k // 32 * 17), np.uint8, Q.MXFP4,
                lambda n=n, k=k: random_mxfp4(n, k, np.random.default_rng(n * k), e))
            floats(p + role + ".bias", e, n, base=0.0, scale=0.01)
    _close(w)
