"""gpt-oss GGUF files with block-typed experts: llama.cpp's q8_0 file, and its f32 file with the experts
rewritten in MXFP4 (``tests.models.gpt_oss.mxfp4_experts`` says why the tests quantize them).

The experts run on the native kernels' block matmuls (MXFP4 as the same weights in Q8_0 blocks):
their weights read back from the kernels' layout are ``gguf``'s dequantization bit for bit. The
reference is transformers' ``GptOssForCausalLM`` holding the file's dequantized weights: with
float32 activations (``weights-only``) the first-step logits agree within 1e-4 and the greedy
tokens are ``generate``'s, for four prompts of 32 tokens, one longer than the sliding window;
with the default integer activations the logits stay within their rounding. The MXFP4 experts are
the directory's within MXFP4's rounding, the rest of the file the directory's bit for bit (their
logits differ from the float directory's by up to 0.7 of the largest logit on these random
weights, so the directory is no reference for MXFP4's greedy tokens). Served under
in-flight batching with mid-flight joins, batched equals alone in both modes.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.gpt_oss import GptOssConfigError
from ifb_plugins.common.models.gpt_oss_gguf import BlockExperts, read_gpt_oss_gguf
from ifb_plugins.text.families import build_family_model
from tests.helpers import alone_and_staggered
from tests.models.gpt_oss import mxfp4_experts
from tests.models.hybrid import hf_greedy, hf_reference
from tests.models.kquant_moe import requantize
from tests.plugins.text.test_gpt_oss import PROMPTS, one_thread  # noqa: F401 (a fixture)

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def files(llama_cpp_families, tmp_path_factory):
    family = llama_cpp_families["gpt_oss"]
    mxfp4 = mxfp4_experts(family.ggufs["f32"], tmp_path_factory.mktemp("gpt_oss_mxfp4") / "gpt_oss-mxfp4.gguf")
    return family.hf_dir, {"q8_0": family.ggufs["q8_0"], "mxfp4": mxfp4}


def _logits(model, ids):
    with torch.no_grad():
        caches = model.allocate_kv_caches(8, 16, torch.float32, "cpu")
        attn = build_attn_metadata([(0, len(ids), list(range(8)))], 16)
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, caches))


def _on_the_files_weights(hf_dir, path):
    """transformers' model of the directory with the file's weights, dequantized by ``gguf``."""
    reference = hf_reference(hf_dir)
    reference.load_state_dict(read_gpt_oss_gguf(path).state, strict=True)
    return reference


def _tokens(result):
    return tuple(result.token_ids)  # the float32 attention's matmuls are not batch-invariant in their last bits


def test_the_experts_on_blocks_are_gguf_dequantization_bit_for_bit(files):
    _, paths = files
    tensors = {t.name: t for t in gguf.GGUFReader(str(paths["mxfp4"])).tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type == Q.MXFP4
    assert tensors["blk.0.attn_q.weight"].tensor_type == Q.F32  # only the experts were rewritten
    model, _ = build_family_model(paths["mxfp4"], quantization="weights-only")
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, BlockExperts) and experts.gate_up[0].qtype == Q.Q8_0  # MXFP4 as Q8_0 blocks

    def dequantized(name, expert):
        t = tensors[name]
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type))[expert].copy())

    for e in (0, 5):
        gate_up = experts.gate_up[e].weight_rows(torch.arange(experts.gate_up[e].out_features))
        want = torch.cat([dequantized("blk.1.ffn_gate_exps.weight", e), dequantized("blk.1.ffn_up_exps.weight", e)])
        assert torch.equal(gate_up, want)
        down = experts.down[e].weight_rows(torch.arange(experts.down[e].out_features))
        assert torch.equal(down, dequantized("blk.1.ffn_down_exps.weight", e))


@pytest.mark.parametrize("kind", ["q8_0", "mxfp4"])
def test_float32_activations_give_transformers_logits_and_greedy_tokens(files, kind):
    hf_dir, paths = files
    reference = _on_the_files_weights(hf_dir, paths[kind])
    model, _ = build_family_model(paths[kind], quantization="weights-only")
    assert all(isinstance(layer.mlp.experts, BlockExperts) for layer in model.model.layers)
    for ids in PROMPTS[:2]:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(_logits(model, ids), ref, atol=1e-4, rtol=0)
    alone, batched = alone_and_staggered(paths[kind], "text", PROMPTS, _tokens, quantization="weights-only")
    assert batched == alone
    for ids, tokens in zip(PROMPTS, alone):
        assert list(tokens) == hf_greedy(reference, ids, 32), kind


def test_integer_activations_stay_within_their_rounding_and_serve_batched_as_alone(files):
    hf_dir, paths = files
    reference = _on_the_files_weights(hf_dir, paths["mxfp4"])
    model, _ = build_family_model(paths["mxfp4"])  # the default: activations to about 15 bits per block
    with torch.no_grad():
        ref = reference(torch.tensor([PROMPTS[0]])).logits[0]
    error = (_logits(model, PROMPTS[0]) - ref).abs().max().item()
    assert 0 < error <= 2e-3, error  # measured 3e-4
    alone, batched = alone_and_staggered(paths["mxfp4"], "text", PROMPTS, _tokens, max_tokens=16)
    assert batched == alone


def test_the_mxfp4_experts_are_the_directorys_within_mxfp4s_rounding(files):
    """Each expert weight is the directory's to within a quarter of its block's largest magnitude (MXFP4's
    scale is ``2^(floor(log2 amax) - 2)`` and its largest code 6: nothing rounds by more than 2 scales),
    and every other tensor is the directory's bit for bit."""
    hf_dir, paths = files
    ours, theirs = read_gpt_oss_gguf(paths["mxfp4"]).state, hf_reference(hf_dir).state_dict()
    for name, tensor in ours.items():
        want = theirs[name]
        if not name.endswith(("gate_up_proj", "down_proj")):
            assert torch.equal(tensor, want), name
            continue
        rows = want.transpose(1, 2)  # [E, out, in]: the blocks run along the input
        amax = rows.reshape(*rows.shape[:2], -1, 32).abs().amax(-1).repeat_interleave(32, -1)
        error = (tensor.transpose(1, 2) - rows).abs()
        assert 0 < error.max() and bool((error <= amax / 4).all()), name


def test_a_tensor_of_a_type_not_read_is_refused_naming_it(files, tmp_path):
    f32 = files[1]["q8_0"].with_name("gpt_oss-f32.gguf")
    path = requantize(f32, tmp_path / "q5_0.gguf", {r"blk\.0\.attn_q\.weight": Q.Q5_0},
                      lambda rows, qtype: gguf.quants.quantize(rows, qtype))
    with pytest.raises(GptOssConfigError, match="blk.0.attn_q.weight is Q5_0"):
        build_family_model(path)
