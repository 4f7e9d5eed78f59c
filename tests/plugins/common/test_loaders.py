"""Tiny random checkpoints through the real loaders: our logits against transformers', and
the paged ragged forward against each sequence alone."""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import pytest
import torch

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.loading.gguf import read_gguf_tensors
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.models.decoder import TextModel, allocate_kv_cache, rope_inv_freq
from tests.models.text import greedy_generate, greedy_generate_batch, save_tiny_checkpoint, save_tiny_gguf

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # Tiny on purpose: with head_dim 16 it puts frequencies in all three llama3 bands.
    "original_max_position_embeddings": 8,
}  # fmt: skip
VARIANTS = {
    "llama": ("llama", None),
    "llama-rope-llama3": ("llama", LLAMA3_SCALING),
    "llama-rope-linear": ("llama", {"type": "linear", "factor": 2.0}),
    "qwen2-bias": ("qwen2", None),
    "qwen3-qknorm": ("qwen3", None),
}
TOL = 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TextModel]:
    arch, scaling = VARIANTS[request.param]
    path = save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=3, rope_scaling=scaling)
    return path, build_model(load_checkpoint(path))


def prefill_logits(model: TextModel, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits of every position of ``ids`` from one prefill step."""
    blocks = list(range(-(-len(ids) // block_size)))
    caches = allocate_kv_cache(model.config, len(blocks), block_size)
    attn = build_attn_metadata([(0, len(ids), blocks)], block_size)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, caches))


def test_logits_match_transformers(tiny: tuple[Path, TextModel]) -> None:
    from transformers import AutoModelForCausalLM

    path, model = tiny
    ids = load_checkpoint(path).tokenizer.encode("The capital of France is Paris. 12345 héllo 🙂")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = prefill_logits(model, ids)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL


def test_ragged_paged_batch_matches_each_sequence_alone(tiny: tuple[Path, TextModel]) -> None:
    _, model = tiny
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seq_a = torch.randint(0, vocab, (14,), generator=g).tolist()
    seq_b = torch.randint(0, vocab, (25,), generator=g).tolist()
    ref_a, ref_b = prefill_logits(model, seq_a), prefill_logits(model, seq_b)

    block_size = 4
    # Interleaved, shuffled block ids: neither sequence owns a contiguous run of the cache.
    table_a, table_b = [9, 2, 15, 4, 11], [0, 7, 13, 3, 8, 1, 12, 5]
    caches = allocate_kv_cache(model.config, 16, block_size)
    # (tokens of A, tokens of B) per step: A prefills whole then decodes; B prefills in two
    # chunks (the second alongside A's decode: a mixed step), then both decode at once.
    steps = [((0, 12), (0, 9)), ((12, 13), (9, 24)), ((13, 14), (24, 25))]
    for (a0, a1), (b0, b1) in steps:
        attn = build_attn_metadata([(a0, a1 - a0, table_a), (b0, b1 - b0, table_b)], block_size)
        ids = seq_a[a0:a1] + seq_b[b0:b1]
        pos = list(range(a0, a1)) + list(range(b0, b1))
        with torch.no_grad():
            logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), attn, caches))
        n_a = a1 - a0
        assert (logits[:n_a] - ref_a[a0:a1]).abs().max().item() <= TOL
        assert (logits[n_a:] - ref_b[b0:b1]).abs().max().item() <= TOL


def test_batched_greedy_equals_single(tiny: tuple[Path, TextModel]) -> None:
    _, model = tiny
    prompts = [[5, 17, 33], list(range(40, 61)), [7] * 9]
    batched = greedy_generate_batch(model, prompts, 12, block_size=4)
    assert batched == [greedy_generate(model, p, 12, block_size=4) for p in prompts]


def test_tiny_gguf_loads_like_the_hf_checkpoint(tmp_path: Path) -> None:
    # Written the way llama.cpp converts (Q/K rows permuted, Q4_1 weights, Q8_0 embedding):
    # our loader must un-permute, so its weights equal the quantize-dequantize round trip.
    hf_dir = save_tiny_checkpoint(tmp_path / "hf", "llama", seed=5)
    gguf_path = save_tiny_gguf(hf_dir, tmp_path / "tiny.gguf")
    from_gguf, from_hf = load_checkpoint(gguf_path), load_checkpoint(hf_dir)
    assert from_gguf.source == "gguf" and from_gguf.config.tie_word_embeddings
    for name, ref in from_hf.state_dict.items():
        qtype = (
            gguf.GGMLQuantizationType.Q8_0 if name == "model.embed_tokens.weight"
            else gguf.GGMLQuantizationType.Q4_1 if ref.ndim == 2 else None
        )  # fmt: skip
        if qtype is not None:
            ref = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(ref.numpy(), qtype), qtype))
        assert torch.equal(from_gguf.state_dict[name], ref), name
    raw = read_gguf_tensors(gguf_path)
    assert raw["model.layers.0.self_attn.q_proj.weight"].ggml_type == gguf.GGMLQuantizationType.Q4_1
    assert raw["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    text = "12345 héllo naïve 🙂 <|im_start|>user\nThe quick brown fox<|im_end|>"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)
    assert from_gguf.tokenizer.eos_token_ids == from_hf.tokenizer.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.tokenizer.apply_chat_template(messages) == from_hf.tokenizer.apply_chat_template(messages)


def test_config_reads_transformers_v5_rope_parameters() -> None:
    base = {
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": [3, 4],
    }  # fmt: skip
    rope_parameters = {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}
    v5 = TextModelConfig.from_hf_config({**base, "rope_parameters": rope_parameters})
    v4 = TextModelConfig.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert v5 == v4 and v5.rope_theta == 5e5 and v5.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert v5.num_kv_heads == 2 and v5.head_dim == 4 and v5.eos_token_ids == (3, 4)
    # GGUF's per-frequency divisors (rope_freqs.weight) scale like linear when all equal.
    factors = attrs.evolve(v5, rope_scaling={"rope_type": "freq_factors", "factors": (4.0,) * 2})
    assert torch.equal(rope_inv_freq(factors), rope_inv_freq(v5))
    with pytest.raises(NotImplementedError, match="yarn"):
        TextModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="not supported"):
        TextModelConfig.from_hf_config({**base, "model_type": "gpt2"})


def test_build_model_is_strict(tmp_path: Path) -> None:
    loaded = load_checkpoint(save_tiny_checkpoint(tmp_path, "llama"))
    del loaded.state_dict["model.norm.weight"]
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        build_model(loaded)


def test_load_checkpoint_rejects_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.gguf")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="neither"):
        load_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
