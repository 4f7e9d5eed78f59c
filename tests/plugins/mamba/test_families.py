"""Nemotron-H, Bamba and Granite 4.0 hybrid against transformers' own models on the same weights.

Each tiny model is built by transformers (``NemotronHForCausalLM``,
``BambaForCausalLM``, ``GraniteMoeHybridForCausalLM``), saved with
``save_pretrained`` and loaded through the plugin's loader.
"""

from __future__ import annotations

import pytest
import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.mamba.layout import build_layout
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from ifb_plugins.mamba.model import allocate_cache
from tests.models.hybrid import SAVERS, hf_reference

FAMILIES = list(SAVERS)
PROMPTS = [
    [5, 77, 13, 250, 9, 31, 31, 180, 4, 66, 120, 7, 299, 42, 3, 88, 15, 201, 19, 140, 23, 60, 11, 97, 300],
    [17, 4, 260],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117, 118],
    [9] * 40,
    [200, 3, 150, 75, 12, 8, 290, 31, 44],
]


@torch.no_grad()
def our_logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits from one prefill step through the stepped model."""
    cache = allocate_cache(model.config, num_seats=1, num_blocks=8, block_size=16)
    layout = build_layout([(0, 0, len(ids), list(range(8)))], 16)
    return model.compute_logits(model(torch.tensor(ids), layout, cache))


@pytest.fixture(scope="module")
def references(family_dirs):
    return {family: hf_reference(path) for family, path in family_dirs.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_logits_match_transformers(family_dirs, references, family):
    model = build_hybrid_model(load_hybrid_dir(family_dirs[family]))
    assert model.config.family == family
    for ids in PROMPTS[:2]:
        with torch.no_grad():
            ref = references[family](torch.tensor([ids])).logits[0]
        ours = our_logits(model, ids)
        assert ref.abs().max() > 1.0  # the logits are not trivially small
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(family_dirs, references, family):
    """The served runtime (8-token prefill chunks, then decodes) picks transformers' argmax at every step."""
    hf = references[family]
    specs = [RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True)) for ids in PROMPTS]
    with LLM(model=str(family_dirs[family]), plugin="mamba", enable_in_flight_batching=True,
             max_num_batched_tokens=8) as llm:
        outs = [llm.engine.submit(spec).result() for spec in specs]
    for ids, out in zip(PROMPTS, outs):
        full = ids + list(out.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([full])).logits[0]
        assert logits[len(ids) - 1:-1].argmax(-1).tolist() == list(out.token_ids)
