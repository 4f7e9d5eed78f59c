"""Qwen3.5's image-text model served through ``LLM(plugin="mamba")`` against transformers on the same tiny
random checkpoint: the tower's features, prompts, first-step logits, greedy tokens with images, batched ==
alone with image requests joining mid-flight, and the chat endpoint with ``image_url`` parts."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from ifb import LLM
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.mamba.layout import build_layout
from ifb_plugins.mamba.loader import split_image_text
from ifb_plugins.mamba.vision import image_processing, read_image_processor
from ifb_plugins.common.media.qwen3_vl_vision import Qwen3VisionConfig, Qwen3VisionTower

from tests.helpers import one_seat_step
from tests.models.qwen3_5_vl import load_processor, save_tiny_qwen3_5_vl
from tests.media_family import (
    GREEDY, NUM_TOKENS, alone, assert_greedy_equals_generate, assert_media_joins_equal_alone, data_url, image_inputs,
    image_request, picture, trace)

#: merged tokens are 32x32 pixels here
PROMPTS = {
    "one image": ["What is in this picture?", picture(1, 64, 64)],
    "two images": [picture(2, 50, 100), "Compare it with", picture(3, 96, 64), "please."],
    "non-square, shrunk": [picture(4, 300, 500), "Describe it."],
    "text only": ["Tell me about a paged KV cache."],
}


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def checkpoint(request, tmp_path_factory):
    return save_tiny_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"), seed=17, moe=request.param)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_processor(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(str(checkpoint), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return model.float().eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    model = LLM(str(checkpoint), plugin="mamba", enable_in_flight_batching=True, max_batch_size=4,
                max_num_batched_tokens=16)
    yield model
    model.close()


@pytest.mark.parametrize("size", [(64, 64), (300, 200), (50, 130)])
def test_tower_features_equal_transformers(checkpoint, processor, reference, size):
    config = json.loads((checkpoint / "config.json").read_text())
    tower = Qwen3VisionTower(Qwen3VisionConfig.from_hf({**config["vision_config"], "deepstack_visual_indexes": []}))
    tower.load_state_dict(split_image_text(load_hf_state_dict(checkpoint), checkpoint)[1], strict=True)
    pre = image_processing(read_image_processor(checkpoint), tower.config)
    img = picture(5, *size)
    ref = processor.image_processor(images=[img], return_tensors="pt")
    pixels, grid = pre(img)
    assert (torch.from_numpy(pixels) - ref["pixel_values"]).abs().max() <= 1e-5
    with torch.no_grad():
        expected = reference.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
    merged, deepstack, _ = tower(torch.from_numpy(pixels), grid)
    assert deepstack.shape[0] == 0
    assert (merged - expected.pooler_output[0]).abs().max() <= 1e-4


def _first_step_logits(runtime, prepared):
    ids = list(prepared.prompt_token_ids)
    blocks = tuple(range(-(-len(ids) // runtime.kv_block_size)))
    step, seats = one_seat_step(prepared, blocks, GREEDY)
    tokens = torch.tensor(ids)
    layout = build_layout([(0, 0, len(ids), list(blocks))], runtime.kv_block_size)
    from ifb_plugins.common.media.prompt import media_step_positions, splice_embeddings

    runtime.cache.clear_seats([0])
    with torch.inference_mode():
        hidden = runtime.model(tokens, layout, runtime.cache, splice_embeddings(step, seats, tokens, runtime.model.embed),
                               media_step_positions(step, seats))
        logits = runtime.model.compute_logits(hidden[-1:])[0]
    runtime.cache.clear_seats([0])
    return logits


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_and_first_step_logits_equal_transformers(llm, processor, reference, name):
    runtime = llm.deployment.runtime
    inputs = image_inputs(processor, PROMPTS[name])
    prepared = runtime.prepare(image_request(PROMPTS[name]))
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = reference(**inputs).logits[0, -1]
    assert (_first_step_logits(runtime, prepared) - expected).abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(llm, processor, reference):
    assert_greedy_equals_generate(llm, reference, PROMPTS, image_request, lambda parts: image_inputs(processor, parts))
    other = ["What is in this picture?", Image.new("RGB", (64, 64), (250, 10, 10))]
    assert trace(alone(llm, image_request(other))) != trace(alone(llm, image_request(PROMPTS["one image"])))


def test_image_requests_join_mid_flight_and_match_their_output_alone(llm):
    # the founder runs long enough that the batch is still running while each later request's media are encoded
    assert_media_joins_equal_alone(llm, PROMPTS, image_request, founder_tokens=96)


def test_context_reuse_never_shares_state_between_different_images(checkpoint, llm):
    specs = [image_request(["What is in this picture?", picture(s, 64, 64)]) for s in (1, 2)]
    expected = [trace(alone(llm, s)) for s in specs]
    with LLM(str(checkpoint), plugin="mamba", enable_in_flight_batching=True, enable_context_reuse=True) as cached:
        first = trace(alone(cached, specs[0]))
        other = trace(alone(cached, specs[1]))  # the same tokens, another image: image 1's state must not serve it
        again = trace(alone(cached, specs[0]))
        hits = cached.health()["prefix_cache"]["hits"]
    assert [first, other] == expected and again == expected[0]
    assert hits >= 1  # the repeated image did reuse its own prefix


def test_chat_endpoint_answers_image_url_parts_as_transformers(llm, processor, reference):
    import asyncio

    import httpx
    from ifb.server import app as app_module

    parts = PROMPTS["one image"]
    inputs = image_inputs(processor, parts)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    app = app_module.build_app(llm.deployment)

    async def post(content):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/v1/chat/completions", json={
                "model": llm.deployment.runtime.model_name, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": content}]})

    good = asyncio.run(post([{"type": "text", "text": parts[0]},
                             {"type": "image_url", "image_url": {"url": data_url(parts[1])}}]))
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["message"]["content"] == expected
    assert good.json()["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    bad = asyncio.run(post([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]))
    assert bad.status_code == 400 and "not an image" in bad.text
    audio = asyncio.run(post([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]))
    assert audio.status_code == 400 and "no audio input" in audio.text


def test_blocking_path_serves_images_with_the_same_output(checkpoint, llm):
    spec = image_request(PROMPTS["two images"])
    with LLM(str(checkpoint), plugin="mamba") as blocking:
        assert trace(alone(blocking, spec)) == trace(alone(llm, spec))
