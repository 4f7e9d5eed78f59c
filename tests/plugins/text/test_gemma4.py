"""Gemma 4 text (``Gemma4ForCausalLM``) against transformers on the same weights, served by the text runtime.

The tiny model has every text feature on (see ``tests.models.gemma4``); one
prompt is longer than the 16-token sliding window, so the sliding layers'
window matters from the first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.gemma4 import Gemma4ConfigError
from ifb_plugins.text.families import build_family_model as build_gemma4
from tests.native import kernels_or_none
from tests.helpers import alone_and_staggered, plain_and_reused
from tests.models.gemma4 import SLIDING_WINDOW, save_tiny_gemma4
from tests.models.hybrid import hf_greedy, hf_reference

PROMPTS = [
    [(7 * i) % 290 + 5 for i in range(40)],  # past the sliding window
    [17, 4, 260],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113],
    [200, 3, 150, 75, 12, 8, 290, 31, 44],
]


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
    return save_tiny_gemma4(tmp_path_factory.mktemp("gemma4"), seed=1)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_reference(model_dir)


def test_first_step_logits_match_transformers(model_dir, reference):
    model, _ = build_gemma4(model_dir)
    c = model.config
    assert c.attention_backend == ("native" if kernels_or_none() is not None else "torch")
    assert [s.kv_source for s in c.layers] == [0, 1, 2, 3, 3, 2]  # the last two read layer 3's and 2's KV
    assert [s.head_dim for s in c.layers] == [16, 16, 32, 16, 16, 32]
    assert c.layers[5].mlp_width == 192 and c.layers[2].values_are_keys and len(PROMPTS[0]) > SLIDING_WINDOW
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


@pytest.mark.parametrize("field, value", [("enable_moe_block", True), ("use_bidirectional_attention", "all"),
                                          ("hidden_activation", "relu")])
def test_an_unsupported_variant_is_refused_naming_the_field(model_dir, tmp_path, field, value):
    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(Gemma4ConfigError, match=field):
        build_gemma4(tmp_path)


@pytest.mark.parametrize("model_type", ["gemma4", "gemma4_assistant"])
def test_the_multimodal_model_and_the_drafter_are_refused_by_model_type(model_dir, tmp_path, model_type):
    cfg = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    with pytest.raises(ValueError, match=f"model_type '{model_type}'"):
        build_gemma4(tmp_path)
