"""Qwen3.5 and Qwen3.5-MoE GGUF files written by llama.cpp's own converter (``qwen35`` / ``qwen35moe``).

The tiny ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` are built and saved by transformers and
converted with ``--no-mtp`` (``tests/models/converted.py`` says why) to f32, bf16 and q8_0. The f32
file's tensors, read back onto ``HybridModel``'s names, are the directory's bit for bit (the
converter's tiled value-head order undone), so its first-step logits are transformers' on the
directory within 1e-4 and it serves the directory's greedy tokens. bf16 and q8_0 round the weights
by more than these tiny random models' greedy choices can bear (the MoE's router flips experts), so
their reference is transformers on the file's own dequantized weights (put back under transformers'
names): first-step logits within 1e-4, and the same greedy tokens. Every file is served under
in-flight batching with mid-flight joins, batched equal to alone.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from ifb_plugins.mamba.config import ConfigError
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir, our_names
from tests.helpers import alone_and_staggered
from tests.models.llama_cpp import OUTTYPES
from tests.models.hybrid import hf_greedy, hf_reference
from tests.models.kquant_moe import requantize
from tests.plugins.mamba.test_families import our_logits
from tests.plugins.mamba.test_qwen3_5 import PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def converted(request, llama_cpp_families):
    return llama_cpp_families[request.param]


@pytest.fixture(scope="module")
def reference(converted):
    return hf_reference(converted.hf_dir)


def _bits(result):
    return result.token_ids, tuple(lp.logprob for lp in result.logprobs)


def test_the_f32_file_holds_the_directorys_tensors_bit_for_bit(converted):
    directory, file = load_hybrid_dir(converted.hf_dir), load_hybrid_dir(converted.ggufs["f32"])
    assert file.config.pattern == directory.config.pattern == "LL*L"
    assert (file.config.rotary_dim, file.config.linear_num_value_heads) == (4, 4)
    ours, theirs = (our_names(d.config.family, d.state_dict) for d in (directory, file))
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), theirs[name]), name
    # the converter did reorder the value heads (4 of them over 2 key heads): undoing it mattered
    stored = {t.name: t for t in gguf.GGUFReader(str(converted.ggufs["f32"])).tensors}["blk.0.attn_gate.weight"]
    z = ours["backbone.layers.0.mixer.in_proj_z.weight"]
    assert not torch.equal(torch.from_numpy(np.array(stored.data)).reshape(z.shape), z)


def transformers_names(state: dict[str, torch.Tensor], pattern: str) -> dict[str, torch.Tensor]:
    """``HybridModel``'s Qwen3.5 tensors under the names (and forms) transformers' model holds:
    the inverse of ``loader.our_names``; ``(1 + w) - 1`` is exact for these norms' weights."""
    out = {}
    for name, t in state.items():
        name = name.replace("backbone.embeddings.", "model.embed_tokens.").replace("backbone.norm_f.", "model.norm.")
        if m := re.fullmatch(r"backbone\.layers\.(\d+)\.(\w+)\.(.*)", name):
            layer, part, rest = int(m.group(1)), m.group(2), m.group(3)
            mixer = "linear_attn" if pattern[layer] == "L" else "self_attn"
            part = {"norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "mixer": mixer,
                    "ffn": "mlp"}[part]
            name = f"model.layers.{layer}.{part}.{rest}"
        if name.endswith(".A"):
            name, t = name + "_log", torch.log(-t)
        elif re.fullmatch(r".*(input_layernorm|post_attention_layernorm|[qk]_norm)\.weight|model\.norm\.weight", name):
            t = t - 1.0
        out[name] = t
    return out


@pytest.mark.parametrize("outtype", list(OUTTYPES))
def test_first_step_logits_and_greedy_tokens_match_transformers_on_the_files_weights(converted, reference,
                                                                                    outtype):
    loaded = load_hybrid_dir(converted.ggufs[outtype])
    model = build_hybrid_model(loaded)
    if outtype != "f32":  # transformers on the file's dequantized weights; f32: on the directory itself
        reference = hf_reference(converted.hf_dir)
        state = transformers_names(our_names(loaded.config.family, loaded.state_dict), loaded.config.pattern)
        reference.load_state_dict(state, strict=True)
    for ids in PROMPTS[:2]:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(our_logits(model, ids), ref, atol=1e-4, rtol=0)
    alone, batched = alone_and_staggered(converted.ggufs[outtype], "mamba", PROMPTS, _bits, max_tokens=16)
    assert batched == alone
    for ids, (tokens, _) in zip(PROMPTS, alone):
        assert list(tokens) == hf_greedy(reference, ids, 16), outtype


def test_a_file_with_the_multi_token_prediction_block_is_refused_naming_the_key(converted, tmp_path):
    arch = "qwen35moe" if converted.hf_dir.name.endswith("moe") else "qwen35"
    path = requantize(converted.ggufs["f32"], tmp_path / "mtp.gguf", {}, lambda rows, qtype: rows,
                      extra_fields={f"{arch}.nextn_predict_layers": 1})
    with pytest.raises(ConfigError, match=f"{arch}.nextn_predict_layers"):
        load_hybrid_dir(path)
