"""Nemotron-H and Granite 4.0 hybrid GGUF files, converted by llama.cpp's converter from transformers-saved models."""

from __future__ import annotations

import gguf
import pytest
import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.mamba.config import ConfigError
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from tests.models.hybrid import hf_reference

from tests.plugins.mamba.test_families import PROMPTS, our_logits

CASES = ("nemotron_h", "granitemoehybrid", "granite_dense")


@pytest.fixture(scope="module", params=CASES)
def converted(request, llama_cpp_families):
    """A transformers-saved hybrid and its float32 GGUF from llama.cpp's converter (tests/models/llama_cpp.py)."""
    family = llama_cpp_families[request.param]
    return family.hf_dir, family.ggufs["f32"]


def test_the_file_has_llama_cpps_names_and_layouts(converted):
    hf_dir, path = converted
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    state = load_hybrid_dir(hf_dir).state_dict
    prefix = "backbone.layers.0.mixer." if "backbone.embeddings.weight" in state else "model.layers.0.mamba."
    a_log, heads = state[prefix + "A_log"], state[prefix + "A_log"].numel()
    ssm_a = tensors["blk.0.ssm_a"]
    assert [int(d) for d in reversed(ssm_a.shape)] == [heads, 1]
    assert torch.equal(torch.from_numpy(ssm_a.data.copy()).reshape(-1), -torch.exp(a_log))
    assert len(tensors["blk.0.ssm_conv1d.weight"].shape) == 2 and "blk.0.ssm_dt.bias" in tensors
    assert [int(d) for d in reversed(tensors["blk.0.ssm_norm.weight"].shape)] == [2, state[prefix + "norm.weight"].numel() // 2]
    assert ("output.weight" in tensors) == ("lm_head.weight" in state)  # tied embeddings: no output tensor
    if path.name.startswith("granitemoehybrid"):
        assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
                "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_shexp.weight", "blk.0.ffn_down_shexp.weight"} <= set(tensors)


def test_gguf_logits_match_transformers_and_serve_what_the_directory_serves(converted):
    hf_dir, path = converted
    model = build_hybrid_model(load_hybrid_dir(path))
    hf = hf_reference(hf_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(our_logits(model, PROMPTS[0]), ref, atol=1e-4, rtol=0)

    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)) for ids in PROMPTS[:4]]
    served = []
    for model_path in (hf_dir, path):
        with LLM(model=str(model_path), plugin="mamba", enable_in_flight_batching=True,
                 max_num_batched_tokens=8) as llm:
            served.append([(r.token_ids, [lp.logprob for lp in r.logprobs])
                           for r in (llm.engine.submit(s).result() for s in specs)])
    # the same tokens; logprobs to float32 rounding (the converter computes some tensors itself,
    # such as ssm_a = -exp(A_log), where the directory's loader computes them with torch)
    assert [t for t, _ in served[0]] == [t for t, _ in served[1]]
    for (_, lps), (_, gguf_lps) in zip(*served):
        assert torch.allclose(torch.tensor(lps), torch.tensor(gguf_lps), atol=1e-5, rtol=0)


def test_a_gguf_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "mamba2.gguf"
    w = gguf.GGUFWriter(str(path), "mamba2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'mamba2' is not a hybrid"):
        load_hybrid_dir(path)
