"""LLaVA against transformers on the same tiny checkpoints: pixels, image features, logits, greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from ifb import LLM
from ifb.params import RequestSpec
from ifb_plugins.vlm.families import load_vlm
from ifb_plugins.common.media.parts import MediaItem
from tests.models.media import png_bytes

from tests.plugins.vlm import tiny
from tests.plugins.vlm.compare import (
    GREEDY, alone, assert_close, chat, first_logits, hf_content, openai_content, pil, reference_greedy,
    reference_inputs,
)

#: each variant: the tower, the layout, vision_feature_layer, vision_feature_select_strategy, pad to square
VARIANTS = {
    "clip-v5": ("clip", "v5", -2, "default", False),
    "clip-hub": ("clip", "hub", -2, "default", False),
    "siglip-v5": ("siglip", "v5", -1, "default", False),
    "siglip-hub-layers-full": ("siglip", "hub", [-3, -1], "full", False),
    "clip-v5-layers-full-pad": ("clip", "v5", [0, -2], "full", True),
    "clip-hub-layers": ("clip", "hub", [-1, -2], "default", False),
}

PROMPTS = {
    "one image": [("image", png_bytes(1, 32, 32)), ("text", "What is in this picture?")],
    "non-square": [("text", "Describe"), ("image", png_bytes(2, 48, 20))],
    "two images": [("image", png_bytes(3, 30, 40)), ("text", "and"), ("image", png_bytes(4, 64, 64)),
                   ("text", "Compare them.")],
    "text only": [("text", "Tell me about paged KV caches.")],
}


#: the variants whose whole prompts are compared (every variant's features are)
SERVED = ("clip-hub", "siglip-v5")


def _build(name, tmp_path_factory):
    tower, layout, layer, strategy, pad = VARIANTS[name]
    path = tiny.llava(tmp_path_factory.mktemp(name), tower=tower, layout=layout, feature_layer=layer,
                      strategy=strategy, pad=pad, seed=len(name))
    return path, *tiny.reference(path, transformers.LlavaForConditionalGeneration)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def test_pixels_and_image_features_match_transformers(checkpoint):
    path, model, processor = checkpoint
    encoder = load_vlm(path).encoders["image"]
    for data in (png_bytes(5, 32, 32), png_bytes(6, 50, 21), png_bytes(7, 17, 33, mode="RGBA")):
        image = pil(data)
        item = MediaItem("image", b"", image)
        expected_pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
        assert torch.equal(torch.from_numpy(encoder.pixel_values(item)), expected_pixels)
        with torch.no_grad():
            expected = model.model.get_image_features(pixel_values=expected_pixels[None]).pooler_output[0]
        encoded = encoder.encode(item)
        assert_close(encoded.embeds, expected)
        assert encoded.token_ids == (model.config.image_token_id,) * expected.shape[0]


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    path, model, processor = _build(request.param, tmp_path_factory)
    with LLM(str(path), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4) as llm:
        yield llm, model, processor


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_prompt_logits_and_greedy_tokens_match_transformers(served, prompt):
    llm, model, processor = served
    parts = PROMPTS[prompt]
    images = [pil(v) for kind, v in parts if kind == "image"]
    inputs = reference_inputs(processor, [{"role": "user", "content": hf_content(parts)}], images=images or None)
    spec = chat(openai_content(parts))
    runtime = llm.deployment.runtime
    prepared = runtime.prepare(spec)
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = model(**inputs).logits[0, -1]
    assert_close(first_logits(runtime, prepared), expected)
    expected_tokens = reference_greedy(model, inputs, GREEDY.max_tokens)
    assert list(alone(llm, spec).token_ids) == expected_tokens


def test_string_content_is_one_text_part(served):
    llm, _, processor = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    expected = reference_inputs(processor, as_parts)["input_ids"][0].tolist()
    # the template filters parts by type: a string would render as nothing
    assert expected != reference_inputs(processor, messages)["input_ids"][0].tolist()
    assert list(llm.deployment.runtime.prepare(RequestSpec(messages=tuple(messages))).prompt_token_ids) == expected
