"""Nemotron 3: Nemotron-H with mixture-of-experts ``E`` layers, against transformers' ``NemotronHForCausalLM``.

The tiny checkpoints are built and saved by transformers (group-limited sigmoid
router with a score correction bias, relu^2 experts, a shared expert; one with
the experts run in a latent). First-step logits, greedy tokens against
``generate``, batched == alone with mid-flight joins, and prefix reuse with the
recurrent-state checkpoints.
"""

from __future__ import annotations

import json

import pytest
import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.mamba.config import ConfigError
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from ifb_plugins.mamba.moe import NemotronMoE
from tests.helpers import alone_and_staggered, plain_and_reused, submit_staggered
from tests.models.hybrid import hf_greedy, hf_reference, save_tiny_nemotron_3
from tests.plugins.mamba.test_families import our_logits

PROMPTS = [
    [5, 77, 13, 250, 9, 31, 31, 180, 4, 66, 120, 7, 299, 42, 3, 88, 15, 201, 19, 140, 23, 60, 11, 97, 300],
    [17, 4, 260],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113],
    [200, 3, 150, 75, 12, 8, 290, 31, 44],
]
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=1)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_nemotron_3(tmp_path_factory.mktemp("nemotron_3"), seed=3)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_reference(model_dir)


@pytest.mark.parametrize("latent", [None, 32])
def test_first_step_logits_match_transformers(model_dir, reference, latent, tmp_path):
    if latent:  # the experts run in a 32-wide latent between fc1_latent_proj and fc2_latent_proj
        model_dir = save_tiny_nemotron_3(tmp_path, seed=4, moe_latent_size=latent)
        reference = hf_reference(model_dir)
    model = build_hybrid_model(load_hybrid_dir(model_dir))
    assert model.config.pattern == "ME*EM-E" and model.config.num_experts == 8
    assert model.config.moe_latent_size == (latent or 0)
    assert sum(isinstance(m, NemotronMoE) for m in model.modules()) == 3
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


def test_prefix_reuse_resumes_from_state_checkpoints(model_dir):
    plain, reused, health, stats = plain_and_reused(model_dir, "mamba", _bits, hybrid_checkpoint_interval=32)
    assert reused == plain
    assert health["prefix_cache"]["hits"] >= 64 * 3  # each later request resumes at the checkpoint at 64
    assert stats["state_checkpoints"] >= 2


@pytest.mark.parametrize("field, value, words", [
    ("n_shared_experts", 2, "n_shared_experts"),
    ("num_nextn_predict_layers", 1, "num_nextn_predict_layers"),
    ("n_group", 3, "n_group"),
])
def test_an_unsupported_variant_is_refused_naming_the_field(model_dir, tmp_path, field, value, words):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    with pytest.raises(ConfigError, match=words):
        load_hybrid_dir(tmp_path)


def test_the_gguf_of_llama_cpps_converter_computes_what_the_directory_does(llama_cpp_families):
    """llama.cpp's ``nemotron_h_moe`` file (float32): the same logits as transformers, the same served tokens."""
    import gguf

    family = llama_cpp_families["nemotron_3"]
    path = family.ggufs["f32"]
    reader = gguf.GGUFReader(str(path))
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "nemotron_h_moe"
    model = build_hybrid_model(load_hybrid_dir(path))
    assert model.config.pattern == "ME*EM-E" and model.config.num_expert_groups == 4
    reference = hf_reference(family.hf_dir)
    for ids in PROMPTS[:2]:
        with torch.no_grad():
            torch.testing.assert_close(our_logits(model, ids), reference(torch.tensor([ids])).logits[0],
                                       atol=1e-4, rtol=0)
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(max_tokens=12, **GREEDY))
             for ids in PROMPTS]
    served = []
    for source in (family.hf_dir, path):
        with LLM(model=str(source), plugin="mamba", enable_in_flight_batching=True, max_batch_size=4,
                 max_num_batched_tokens=8) as llm:
            served.append([r.token_ids for r in submit_staggered(llm.engine, specs, gap_steps=2)])
    assert served[0] == served[1]
