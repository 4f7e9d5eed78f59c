"""Qwen3-VL served through ``LLM(plugin="vlm")`` against transformers on the same tiny random checkpoint:
tower and DeepStack features, prompts, first-step logits, greedy tokens, batched == alone."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from ifb import LLM
from ifb_plugins.common.loading.processor import ProcessorFiles
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.vlm.qwen2_5_vl import split_state
from ifb_plugins.common.media.qwen2_5_vl_image import QwenVLImageProcessing
from ifb_plugins.common.media.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

from tests.media_family import (
    alone, assert_greedy_equals_generate, assert_media_joins_equal_alone, image_inputs, image_request, paged_first_step_logits, picture, trace)
from tests.plugins.vlm.tiny_qwen2_5_vl import IMAGE_TOKEN_ID, load_processor, save_tiny_qwen3_vl

import transformers

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
    inputs = image_inputs(processor, PROMPTS[name])
    prepared = runtime.prepare(image_request(PROMPTS[name]))
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = reference(**inputs).logits[0, -1]
    assert (paged_first_step_logits(runtime, prepared) - expected).abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(llm, processor, reference):
    assert_greedy_equals_generate(llm, reference, PROMPTS, image_request, lambda parts: image_inputs(processor, parts))
    other = ["What is in this picture?", Image.new("RGB", (64, 64), (250, 10, 10))]
    assert trace(alone(llm, image_request(other))) != trace(alone(llm, image_request(PROMPTS["one image"])))


def test_media_requests_join_mid_flight_and_match_their_output_alone(llm):
    # the founder runs long enough that the batch is still running while each later request's media are encoded
    assert_media_joins_equal_alone(llm, PROMPTS, image_request, founder_tokens=128)


def test_pruning_cuts_image_rows_with_their_deepstack_features(llm):
    runtime = llm.deployment.runtime
    spec = image_request(PROMPTS["non-square, shrunk"])
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
