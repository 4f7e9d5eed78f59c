"""Qwen3.5 (dense and MoE): Gated DeltaNet layers beside gated attention, against transformers'
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` on the same weights, served by the hybrid runtime.

transformers prefills in the chunked (UT-transform) form; the plugin runs the
recurrent form token by token: first-step logits agree within 1e-4, greedy
tokens equal ``generate``'s, batched equals alone bit for bit with joiners
prefilling in 8-token chunks, and prefix reuse resumes from the DeltaNet
state checkpoints.
"""

from __future__ import annotations

import json

import pytest
import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.mamba.config import ConfigError
from ifb_plugins.mamba.deltanet import GatedDeltaNet
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from tests.helpers import alone_and_staggered, plain_and_reused
from tests.models.hybrid import hf_greedy, hf_reference, save_tiny_qwen3_5
from tests.plugins.mamba.test_families import our_logits

PROMPTS = [
    [5, 77, 13, 250, 9, 31, 31, 180, 4, 66, 120, 7, 299, 42, 3, 88, 15, 201, 19, 140, 23, 60, 11, 97, 300],
    [17, 4, 260],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113],
    [200, 3, 150, 75, 12, 8, 290, 31, 44],
]
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=1)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_dir(request, tmp_path_factory):
    return save_tiny_qwen3_5(tmp_path_factory.mktemp(f"qwen3_5_{request.param}"), seed=5,
                             moe=request.param == "moe")


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_reference(model_dir)


def test_first_step_logits_match_transformers(model_dir, reference):
    model = build_hybrid_model(load_hybrid_dir(model_dir))
    assert model.config.pattern == "LL*L" and model.config.rotary_dim == 4  # a quarter of each head
    assert sum(isinstance(m, GatedDeltaNet) for m in model.modules()) == 3
    for ids in PROMPTS:
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        ours = our_logits(model, ids)
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def _bits(result):
    return result.token_ids, tuple(lp.logprob for lp in result.logprobs)


def test_greedy_tokens_equal_generate_and_batched_equals_alone(model_dir, reference):
    alone, batched = alone_and_staggered(model_dir, "mamba", PROMPTS, _bits)
    assert batched == alone
    for ids, (tokens, _) in zip(PROMPTS, alone):
        assert list(tokens) == hf_greedy(reference, ids, 32)


def test_prefix_reuse_resumes_from_deltanet_state_checkpoints(model_dir):
    plain, reused, health, stats = plain_and_reused(model_dir, "mamba", _bits, hybrid_checkpoint_interval=32)
    assert reused == plain
    assert health["prefix_cache"]["hits"] >= 64 * 3  # each later request resumes at the checkpoint at 64
    assert stats["state_checkpoints"] >= 2


def test_an_image_text_config_without_its_text_config_and_unknown_layers_are_refused_naming_the_field(model_dir, tmp_path):
    cfg = json.loads((model_dir / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    for bad, words in [({"model_type": "qwen3_5"}, "text_config"),
                       ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
                       ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"linear_num_value_heads": 3}, "linear_num_value_heads")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ConfigError, match=words):
            load_hybrid_dir(tmp_path)


def test_a_preempted_request_recomputes_its_deltanet_state(model_dir):
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(max_tokens=30, **GREEDY))
             for ids in PROMPTS]
    with LLM(model=str(model_dir), plugin="mamba") as llm:
        alone = [_bits(llm.engine.submit(spec).result()) for spec in specs]
    # 96 tokens of KV for four answers of 33-55 tokens each: the youngest residents must leave
    with LLM(model=str(model_dir), plugin="mamba", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16, max_kv_cache_capacity=96) as llm:
        results = [_bits(h.result()) for h in [llm.engine.submit(spec) for spec in specs]]
        scheduling = llm.health()["scheduling"]
    assert scheduling["preempted"] > 0 and scheduling["completed"] == len(specs)
    assert results == alone
