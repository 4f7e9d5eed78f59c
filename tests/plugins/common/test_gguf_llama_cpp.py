"""GGUF files written by llama.cpp's own converter, against transformers on the directory they came from.

Each family's tiny checkpoint is built with transformers' classes and saved with
``save_pretrained``; llama.cpp's ``convert_hf_to_gguf.py`` (llama-cpp-python 0.3.36's vendored
llama.cpp, ``tests/models/llama_cpp.py``) converts it to ``f32``, ``bf16`` and ``q8_0``, the types
it writes itself. ifb on each file is compared with transformers: first-step logits on the
directory (float32: 1e-4; bf16 and q8_0: within the rounding of their weights), and, on the same
weights (the directory's model with the file's dequantized tensors loaded), logits to 1e-4 and
greedy tokens served under in-flight batching with staggered arrivals.

The K-quants (Q4_K, Q5_K, Q6_K) and the other block types need llama.cpp's C++ ``llama-quantize``,
which the sdist does not build without a toolchain run: those files are still written by the
tests' own writer (``test_kquants.py``), whose blocks are checked bit for bit against
``gguf.quants``, llama.cpp's Python reference of the same formats.
"""

from __future__ import annotations

import pytest
import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from tests.helpers import submit_staggered
from tests.models import llama_cpp
from tests.models.converted import FAMILIES
from tests.plugins.common.test_loaders import prefill_logits
from tests.plugins.mamba.test_families import our_logits

HYBRIDS = ("nemotron_h", "granitemoehybrid", "granite_dense")
MOE = ("qwen3_moe", "mixtral")
PROMPT = [5, 17, 33, 90, 4, 200, 11, 7, 61, 250, 12, 3]
PROMPTS = [[5, 17, 33, 90], [3, 4, 5, 6, 7, 8, 9, 10, 11], [250, 12], list(range(40, 52))]
#: the largest logit error, relative to the largest logit, that a file's weight rounding may cause
#: (bf16: 8 bits of mantissa; q8_0: 8-bit codes per block of 32); measured at about half of it
BOUND = {"f32": None, "bf16": 2e-2, "q8_0": 5e-2}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def ifb_logits(family: str, path) -> torch.Tensor:
    with torch.no_grad():
        if family in HYBRIDS:
            return our_logits(build_hybrid_model(load_hybrid_dir(path)), PROMPT)
        return prefill_logits(build_model(load_checkpoint(path)), PROMPT)


@pytest.mark.parametrize("outtype", llama_cpp.OUTTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_gguf_logits_match_transformers(llama_cpp_families, family: str, outtype: str) -> None:
    converted = llama_cpp_families[family]
    path = converted.ggufs[outtype]
    ours = ifb_logits(family, path)
    with torch.no_grad():
        ref = hf_model(converted.hf_dir)(torch.tensor([PROMPT])).logits[0]
    error = (ours - ref).abs().max().item()
    if outtype == "f32":
        assert error <= 1e-4, error
    elif family not in MOE:  # a tiny random router flips expert choices under 8-bit rounding
        assert error <= BOUND[outtype] * ref.abs().max().item(), error
    if family in HYBRIDS:
        return  # their tensors are renamed onto HybridModel's names: the directory is their reference
    same = hf_model(converted.hf_dir)
    missing = same.load_state_dict(load_checkpoint(path).state_dict, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    same.tie_weights()
    with torch.no_grad():
        torch.testing.assert_close(ours, same(torch.tensor([PROMPT])).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_gguf_serves_transformers_greedy_tokens_under_in_flight_batching(llama_cpp_families,
                                                                                    family: str) -> None:
    # q8_0 on float32 activations (``weights-only``): transformers on the file's dequantized weights
    # is then the same arithmetic up to summation order; f32: transformers on the directory itself
    converted = llama_cpp_families[family]
    for outtype in ("f32",) if family in HYBRIDS else ("f32", "q8_0"):
        path = converted.ggufs[outtype]
        ref = hf_model(converted.hf_dir)
        if outtype != "f32":
            ref.load_state_dict(load_checkpoint(path).state_dict, strict=False)
            ref.tie_weights()
        with torch.no_grad():
            want = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        kwargs = {"plugin": "mamba"} if family in HYBRIDS else {"quantization": "weights-only"}
        with LLM(model=str(path), enable_in_flight_batching=True, max_batch_size=4,
                 max_num_batched_tokens=8, **kwargs) as llm:
            # a longer first request keeps the batch running, so the six-token ones arrive mid-flight
            founder = RequestSpec(prompt_token_ids=tuple(PROMPTS[0]), params=SamplingParams(
                temperature=0.0, max_tokens=32, ignore_eos=True))
            got = submit_staggered(llm.engine, [founder] + [RequestSpec(prompt_token_ids=tuple(p), params=params)
                                                            for p in PROMPTS], gap_steps=1)
        assert [list(r.token_ids) for r in got[1:]] == want, (family, outtype)


def test_mistral_on_the_native_decoder_serves_transformers_greedy_tokens_under_in_flight_batching(
        llama_cpp_families) -> None:
    """The Mistral architecture on the native path: llama.cpp's q8_0 file of a ``MistralForCausalLM``, served
    by the native whole-stack decoder under in-flight batching (staggered, joins asserted), gives
    transformers' greedy tokens on the file's dequantized weights, in the default (integer) mode alone
    and batched alike, and in ``weights-only`` exactly transformers'."""
    from ifb_plugins.common.models.native_decoder import NativeDecoder

    converted = llama_cpp_families["mistral"]
    path = converted.ggufs["q8_0"]
    ref = hf_model(converted.hf_dir)
    assert type(ref).__name__ == "MistralForCausalLM"
    ref.load_state_dict(load_checkpoint(path).state_dict, strict=False)
    with torch.no_grad():
        want = [ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    specs = [RequestSpec(prompt_token_ids=tuple(p), params=params) for p in PROMPTS]
    for quantization in ("auto", "weights-only"):
        with LLM(model=str(path), quantization=quantization, enable_in_flight_batching=True, max_batch_size=4,
                 max_num_batched_tokens=8) as llm:
            assert isinstance(llm.deployment.runtime.model.layer_stack, NativeDecoder), quantization
            alone = [list(llm.engine.submit(s).result().token_ids) for s in specs]
            got = [list(r.token_ids) for r in submit_staggered(llm.engine, specs, gap_steps=1)]
        assert got == alone, quantization
        if quantization == "weights-only":
            assert got == want
