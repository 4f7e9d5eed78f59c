"""Qwen3-VL served through ``LLM(plugin="vlm")`` against transformers on the same tiny random checkpoint:
tower and DeepStack features, prompts, first-step logits, greedy tokens, batched == alone."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from ifb import LLM, SamplingParams
from ifb_plugins.common.loading.processor import ProcessorFiles
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.vlm.qwen2_5_vl import split_state
from ifb_plugins.common.media.qwen2_5_vl_image import QwenVLImageProcessing
from ifb_plugins.common.media.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

from tests.helpers import submit_staggered
from tests.plugins.vlm.test_qwen2_5_vl import _attn, alone, ours, picture, reference_inputs, trace
from tests.plugins.vlm.tiny_qwen2_5_vl import IMAGE_TOKEN_ID, load_processor, save_tiny_qwen3_vl
from tests.helpers import one_seat_step

import transformers

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)

#: merged tokens are 32x32 pixels here
PROMPTS = {
    "one image": ["What is in this picture?", picture(1, 64, 64)],
    "two images": [picture(2, 50, 100), "Compare it with", picture(3, 96, 64), "please."],
    "non-square, shrunk": [picture(4, 300, 500), "Describe it."],
    "text only": ["Tell me about a paged KV cache."],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), seed=13)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_processor(checkpoint, "qwen3_vl")


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Qwen3VLForConditionalGeneration

    model, info = Qwen3VLForConditionalGeneration.from_pretrained(str(checkpoint), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return model.eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    model = LLM(str(checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
                max_num_batched_tokens=16)
    yield model
    model.close()


@pytest.mark.parametrize("size", [(64, 64), (300, 200), (50, 130)])
def test_tower_and_deepstack_features_equal_transformers(checkpoint, processor, reference, size):
    config = json.loads((checkpoint / "config.json").read_text())
    tower = Qwen3VisionTower(Qwen3VisionConfig.from_hf(config["vision_config"]))
    tower.load_state_dict(split_state(load_hf_state_dict(checkpoint))[1], strict=True)
    pre = QwenVLImageProcessing.from_hf(ProcessorFiles.read(checkpoint).image_processor)
    img = picture(5, *size)
    ref = processor.image_processor(images=[img], return_tensors="pt")
    with torch.no_grad():
        expected = reference.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
    pixels, grid = pre(img)
    merged, deepstack, importance = tower(torch.from_numpy(pixels), grid)
    assert (merged - expected.pooler_output[0]).abs().max() <= 1e-4
    assert len(deepstack) == len(expected.deepstack_features) == 2
    for ours_layer, (theirs,) in zip(deepstack, expected.deepstack_features):
        assert (ours_layer - theirs).abs().max() <= 1e-4
    assert importance.shape == (merged.shape[0],)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_and_first_step_logits_equal_transformers(llm, processor, reference, name):
    runtime = llm.deployment.runtime
    inputs = reference_inputs(processor, PROMPTS[name])
    prepared = runtime.prepare(ours(PROMPTS[name]))
    ids = list(prepared.prompt_token_ids)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = reference(**inputs).logits[0, -1]
    step, seats = one_seat_step(prepared, tuple(range(-(-len(ids) // runtime.kv_block_size))), GREEDY)
    seq = step.seqs[0]
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        hidden = runtime.model(tokens, runtime.step_positions(step, seats), _attn(runtime, seq, seats[0]), runtime.kv_caches,
                               runtime.step_embeddings(step, seats, tokens))
        logits = runtime.model.compute_logits(hidden[-1:])[0]
    assert (logits - expected).abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(llm, processor, reference):
    for name, parts in PROMPTS.items():
        inputs = reference_inputs(processor, parts)
        with torch.no_grad():
            out = reference.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None)
        expected = out[0, inputs["input_ids"].shape[1]:].tolist()
        assert len(expected) == NUM_TOKENS
        assert list(alone(llm, ours(parts)).token_ids) == expected, name
    other = ["What is in this picture?", Image.new("RGB", (64, 64), (250, 10, 10))]
    assert trace(alone(llm, ours(other))) != trace(alone(llm, ours(PROMPTS["one image"])))


def test_media_requests_join_mid_flight_and_match_their_output_alone(llm):
    # long enough that the batch is still running while each later request's image is encoded
    long_text = ours(["Tell me a long story about in-flight batching."],
                     SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, logprobs=1))
    specs = [long_text] + [ours(parts) for parts in PROMPTS.values()]
    solo = [trace(alone(llm, s)) for s in specs]
    before = llm.health()["scheduling"]
    batched = submit_staggered(llm.engine, specs, gap_steps=2)
    after = llm.health()["scheduling"]
    assert [trace(r) for r in batched] == solo
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] >= 3


def test_pruning_cuts_image_rows_with_their_deepstack_features(llm):
    runtime = llm.deployment.runtime
    spec = ours(PROMPTS["non-square, shrunk"])
    full = runtime.prepare(spec)
    runtime.pruner_ratio = 0.5
    try:
        kept = runtime.prepare(spec)
        result = alone(llm, spec)
    finally:
        runtime.pruner_ratio = None
    (_, full_rows), = full.state.media.embeds
    (_, kept_rows), = kept.state.media.embeds
    assert kept_rows.shape[1] == full_rows.shape[1] == 3 * 64  # embedding + two DeepStack features
    assert kept.prompt_token_ids.count(IMAGE_TOKEN_ID) == -(-full.prompt_token_ids.count(IMAGE_TOKEN_ID) // 2)
    matches = [int((full_rows == row).all(dim=1).nonzero()[0]) for row in kept_rows]
    assert matches == sorted(matches)
    assert result.num_prompt_tokens == len(kept.prompt_token_ids)
