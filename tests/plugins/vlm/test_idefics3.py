"""SmolVLM / Idefics3 against transformers on the same tiny checkpoints: tiles, features, prompts, logits, tokens."""

from __future__ import annotations

import pytest
import torch
import transformers

from ifb import LLM, SamplingParams
from ifb_plugins.vlm.families import load_vlm
from ifb_plugins.common.media.parts import MediaItem
from tests.models.media import png_bytes

from tests.plugins.vlm import tiny
from tests.plugins.vlm.compare import (
    GREEDY, alone, assert_batched_equals_alone, assert_close, chat, first_logits, hf_content, openai_content, pil,
    reference_greedy, reference_inputs,
)

#: each variant: SmolVLM's classes (else Idefics3's), image splitting
VARIANTS = {"idefics3-tiles": (False, True), "smolvlm-tiles": (True, True), "smolvlm-global-only": (True, False)}
CLASSES = {False: transformers.Idefics3ForConditionalGeneration, True: transformers.SmolVLMForConditionalGeneration}

PROMPTS = {
    "one image": [("image", png_bytes(1, 32, 32)), ("text", "What is in this picture?")],
    "non-square": [("image", png_bytes(2, 70, 20)), ("text", "Describe it")],
    "two images": [("image", png_bytes(3, 30, 40)), ("text", "and"), ("image", png_bytes(4, 64, 64)),
                   ("text", "Compare them.")],
    "text only": [("text", "Tell me about paged KV caches.")],
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    smolvlm, splitting = VARIANTS[request.param]
    path = tiny.idefics3(tmp_path_factory.mktemp(request.param), smolvlm=smolvlm, splitting=splitting,
                         seed=len(request.param))
    return path, *tiny.reference(path, CLASSES[smolvlm])


def test_tiles_and_image_features_match_transformers(checkpoint):
    path, model, processor = checkpoint
    encoder = load_vlm(path).encoders["image"]
    for data in (png_bytes(5, 32, 32), png_bytes(6, 90, 21), png_bytes(7, 17, 33, mode="RGBA")):
        image = pil(data)
        item = MediaItem("image", b"", image)
        expected = processor.image_processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
        frames, rows, cols = encoder.pixel_values(item)
        assert torch.equal(torch.from_numpy(frames), expected["pixel_values"][0])
        assert (rows, cols) == (expected["rows"][0][0], expected["cols"][0][0])
        with torch.no_grad():
            features = model.model.get_image_features(
                pixel_values=expected["pixel_values"],
                pixel_attention_mask=expected["pixel_attention_mask"]).pooler_output[0]
        assert_close(encoder.encode(item).embeds, features)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tiny.idefics3(tmp_path_factory.mktemp("served"), smolvlm=True, splitting=True, seed=5)
    model, processor = tiny.reference(path, transformers.SmolVLMForConditionalGeneration)
    with LLM(str(path), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4) as llm:
        yield llm, model, processor


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_prompt_logits_and_greedy_tokens_match_transformers(served, prompt):
    llm, model, processor = served
    parts = PROMPTS[prompt]
    images = [pil(v) for kind, v in parts if kind == "image"]
    inputs = reference_inputs(processor, [{"role": "user", "content": hf_content(parts)}], images=images or None)
    inputs.pop("rows", None), inputs.pop("cols", None)
    spec = chat(openai_content(parts))
    runtime = llm.deployment.runtime
    prepared = runtime.prepare(spec)
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = model(**inputs).logits[0, -1]
    assert_close(first_logits(runtime, prepared), expected)
    assert list(alone(llm, spec).token_ids) == reference_greedy(model, inputs, GREEDY.max_tokens)


def test_media_requests_join_mid_flight_and_match_their_output_alone(served):
    llm, _, _ = served
    long_text = chat([{"type": "text", "text": "Tell me a long story about a paged KV cache."}],
                     SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, logprobs=1))
    specs = [long_text, *(chat(openai_content(PROMPTS[p])) for p in ("two images", "non-square", "one image"))]
    assert_batched_equals_alone(llm, specs)
