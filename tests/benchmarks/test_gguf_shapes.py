"""``benchmarks/gguf_shapes.py``: llama.cpp's quantization mixes, and files ifb loads as written."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import attrs
import gguf
import pytest

from ifb_plugins.common.loading.gguf import load_gguf, read_gguf_tensors

ROOT = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def shapes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gguf_shapes", ROOT / "benchmarks" / "gguf_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_q4_k_m_gives_more_bits_and_takes_llama_cpps_fallbacks(shapes) -> None:
    # 24 layers: the first and last 3 and every third between get Q6_K for V and down
    more = [i for i in range(24) if shapes.more_bits(i, 24)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert shapes.matrix_type("Q4_K_M", "attn_q", 0, 24, 1536) == Q.Q4_K
    assert shapes.matrix_type("Q4_K_M", "attn_v", 0, 24, 1536) == Q.Q6_K
    assert shapes.matrix_type("Q4_K_M", "attn_v", 3, 24, 1536) == Q.Q4_K
    assert shapes.matrix_type("Q4_K_M", "output", 0, 24, 1536) == Q.Q6_K
    # 896 is not whole super-blocks: Q4_K -> Q5_0, Q6_K -> Q8_0
    assert shapes.matrix_type("Q4_K_M", "attn_q", 0, 24, 896) == Q.Q5_0
    assert shapes.matrix_type("Q4_K_M", "attn_v", 0, 24, 896) == Q.Q8_0
    assert shapes.matrix_type("Q8_0", "ffn_down", 0, 24, 4864) == Q.Q8_0
    # Q5_K_M: Q5_K in Q4_K's place, Q5_1 its fallback
    assert shapes.matrix_type("Q5_K_M", "attn_q", 0, 24, 1536) == Q.Q5_K
    assert shapes.matrix_type("Q5_K_M", "ffn_down", 0, 24, 4864) == Q.Q6_K
    assert shapes.matrix_type("Q5_K_M", "ffn_down", 3, 24, 4864) == Q.Q5_K
    assert shapes.matrix_type("Q5_K_M", "ffn_up", 3, 24, 896) == Q.Q5_1
    with pytest.raises(ValueError, match="unknown mix"):
        shapes.matrix_type("Q2_K", "attn_q", 0, 24, 896)


def test_a_written_file_loads_with_the_shapes_and_types_it_was_given(shapes, tmp_path: Path) -> None:
    shape = attrs.evolve(shapes.SHAPES["qwen2.5-1.5b"], num_layers=2, hidden=256, intermediate=512, num_heads=4,
                         vocab=512)
    path = tmp_path / "tiny.gguf"
    counts = shapes.write_gguf(path, shape, "Q4_K_M", context_length=64)
    assert counts == {"Q6_K": 3, "Q4_K": 12}  # the last layer's V and down, and the tied head
    tensors = read_gguf_tensors(path)
    assert tensors["model.layers.1.self_attn.v_proj.weight"].ggml_type == Q.Q6_K
    assert tensors["model.layers.0.self_attn.v_proj.weight"].ggml_type == Q.Q4_K
    assert tensors["model.layers.1.mlp.up_proj.weight"].shape == (512, 256)
    config = load_gguf(path)[0]  # no tokenizer in this file: the config and weights only
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.vocab_size) == (2, 256, 2, 512)
    assert shapes.tensor_bytes(path) == sum(t.data.nbytes for t in gguf.GGUFReader(str(path)).tensors)
    assert shapes.write_gguf(tmp_path / "q5.gguf", shape, "Q5_K_M", context_length=64) == {"Q6_K": 3, "Q5_K": 12}
    assert gguf.GGUFReader(str(tmp_path / "q5.gguf")).fields["general.file_type"].parts[-1][0] == \
        gguf.LlamaFileType.MOSTLY_Q5_K_M


@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b", "qwen3-30b-a3b"])
def test_a_written_mixture_of_experts_loads_with_llama_cpps_q4_k_m_types(shapes, tmp_path: Path, name: str) -> None:
    shape = attrs.evolve(shapes.MOE_SHAPES[name], num_layers=2, hidden=256, num_heads=4, num_kv_heads=2,
                         head_dim=64, num_experts=8, top_k=2, expert_intermediate=384, vocab=512,
                         shared_intermediate=512 if shapes.MOE_SHAPES[name].shared_intermediate else 0)
    path = tmp_path / "tiny-moe.gguf"
    counts = shapes.write_moe_gguf(path, shape, "Q4_K_M", context_length=64)
    tensors = read_gguf_tensors(path)
    # 2 layers: the last is a more-bits layer, so its V and expert down (and the shared expert's) are Q6_K;
    # 384 is not whole super-blocks, so the first layer's expert down falls back to Q5_0 and the last's to Q8_0
    down = {i: tensors[f"model.layers.{i}.mlp.experts.down_proj.weight"] for i in (0, 1)}
    assert (down[0].ggml_type, down[1].ggml_type) == (Q.Q5_0, Q.Q8_0)
    assert tensors["model.layers.1.self_attn.v_proj.weight"].ggml_type == Q.Q6_K
    assert tensors["model.layers.0.mlp.experts.gate_proj.weight"].ggml_type == Q.Q4_K
    assert tensors["model.layers.0.mlp.experts.gate_proj.weight"].shape == (8, 384, 256)
    assert tensors["lm_head.weight"].ggml_type == Q.Q6_K
    if shape.shared_intermediate:
        assert tensors["model.layers.1.mlp.shared_expert.down_proj.weight"].ggml_type == Q.Q6_K
        assert tensors["model.layers.0.mlp.shared_expert.down_proj.weight"].ggml_type == Q.Q4_K
    assert sum(counts.values()) == 2 + 2 * (4 + 3 + (3 if shape.shared_intermediate else 0))
    config = load_gguf(path)[0]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 384)
    assert config.shared_expert_intermediate_size == shape.shared_intermediate
    # a token streams every tensor but the looked-up embedding, and a quarter (2 of 8) of each expert tensor
    reader = gguf.GGUFReader(str(path))
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    embedding = next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    assert shapes.active_tensor_bytes(path) == shapes.tensor_bytes(path) - experts + experts // 4
    assert shapes.tensor_bytes(path) == sum(int(t.n_bytes) for t in reader.tensors) - embedding
