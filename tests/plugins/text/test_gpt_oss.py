"""gpt-oss (``GptOssForCausalLM``) against transformers on the same weights, served by the text runtime.

The tiny model (``tests.models.gpt_oss``) has attention sinks, alternating
sliding-window and full layers, YaRN RoPE and 8 experts with the clamped
SwiGLU; one prompt is longer than the 16-token sliding window, so the window
matters from the first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.gpt_oss import GptOssConfigError
from ifb_plugins.text.families import build_family_model as build_gpt_oss
from tests.native import kernels_or_none
from tests.helpers import alone_and_staggered, plain_and_reused, submit_staggered
from tests.models.gpt_oss import SLIDING_WINDOW, save_tiny_gpt_oss
from tests.models.hybrid import hf_greedy, hf_reference

PROMPTS = [
    [(7 * i) % 290 + 5 for i in range(40)],  # past the sliding window
    [17, 4, 260],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113],
    [200, 3, 150, 75, 12, 8, 290, 31, 44],
]
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Single-threaded torch: on a small shared machine OpenMP's spinning barriers make these tiny
    models' small ops many times slower with several threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), seed=1)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_reference(model_dir)


def test_first_step_logits_match_transformers(model_dir, reference):
    model, _ = build_gpt_oss(model_dir)
    c = model.config
    assert c.attention_backend == ("native" if kernels_or_none() is not None else "torch")
    assert c.layer_types[0] == "sliding_attention" and c.sliding_window == SLIDING_WINDOW < len(PROMPTS[0])
    assert dict(c.rope)["rope_type"] == "yarn"
    assert all(layer.self_attn.sinks.abs().max() > 0.1 for layer in model.model.layers)
    for ids in PROMPTS:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
            caches = model.allocate_kv_caches(8, 16, torch.float32, "cpu")
            attn = build_attn_metadata([(0, len(ids), list(range(8)))], 16)
            ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, caches))
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _tokens(result):
    return result.token_ids


def test_greedy_tokens_equal_generate_and_batched_equals_alone(model_dir, reference):
    alone, batched = alone_and_staggered(model_dir, "text", PROMPTS, _tokens)
    assert batched == alone
    for ids, tokens in zip(PROMPTS, alone):
        assert list(tokens) == hf_greedy(reference, ids, 32)


def test_prefix_reuse_hits_and_changes_nothing(model_dir):
    plain, reused, health, _ = plain_and_reused(model_dir, "text", _tokens)
    assert reused == plain
    assert health["prefix_cache"]["hits"] >= 64 * 3  # the system prompt's four full blocks, three times


@pytest.mark.parametrize("field, value", [("quantization_config", {"quant_method": "mxfp4"}),
                                          ("layer_types", ["sliding_attention", "chunked_attention"]),
                                          ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1.0})])
def test_an_unsupported_variant_is_refused_naming_the_field(model_dir, tmp_path, field, value):
    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(GptOssConfigError, match=field.split('_')[0]):
        build_gpt_oss(tmp_path)


def test_the_gguf_of_llama_cpps_converter_serves_what_the_directory_serves(llama_cpp_families):
    """llama.cpp's ``gpt-oss`` file: float32 gives the directory's logits and served tokens (its block-typed
    files: test_gpt_oss_gguf.py)."""
    family = llama_cpp_families["gpt_oss"]
    ours, _ = build_gpt_oss(family.ggufs["f32"])
    reference, _ = build_gpt_oss(family.hf_dir)
    ids = PROMPTS[0]
    with torch.no_grad():
        def logits(model):
            caches = model.allocate_kv_caches(8, 16, torch.float32, "cpu")
            attn = build_attn_metadata([(0, len(ids), list(range(8)))], 16)
            return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, caches))
        torch.testing.assert_close(logits(ours), logits(reference), atol=1e-5, rtol=0)
    specs = [RequestSpec(prompt_token_ids=tuple(p), params=SamplingParams(max_tokens=12, **GREEDY)) for p in PROMPTS]
    served = []
    for source in (family.hf_dir, family.ggufs["f32"]):
        with LLM(model=str(source), plugin="text", enable_in_flight_batching=True, max_batch_size=4,
                 max_num_batched_tokens=8) as llm:
            served.append([r.token_ids for r in submit_staggered(llm.engine, specs, gap_steps=2)])
    assert served[1] == served[0]
