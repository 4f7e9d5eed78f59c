"""Gemma 4 (``Gemma4ForConditionalGeneration``) served through ``LLM(plugin="vlm")`` against transformers on the
same tiny random checkpoint: the vision and audio towers' features, prompts, first-step logits, greedy tokens
with images and audio, batched == alone with media requests joining mid-flight, and the chat endpoint with
``image_url`` and ``input_audio`` parts."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from ifb import LLM
from ifb_plugins.common.media.parts import MediaItem

from ifb.params import RequestSpec
from ifb_plugins.common.media.parts import decode_wav

from tests.models.gemma4_vlm import load_processor, save_tiny_gemma4_vlm
from tests.models.media import audio_part, wav_bytes
from tests.media_family import (
    GREEDY, NUM_TOKENS, alone, assert_greedy_equals_generate, assert_media_joins_equal_alone, data_url,
    paged_first_step_logits, picture, trace)


class clip:
    """An audio part: WAV bytes, and the samples the server decodes them to (what the processor is given)."""

    def __init__(self, seed: int, seconds: float) -> None:
        self.raw = wav_bytes(seed, seconds)
        self.samples = decode_wav(self.raw, "clip", 16000)


#: soft tokens are 12x12 pixels (at most 70 per image) or 40 ms of audio
PROMPTS = {
    "one image": ["What is in this picture?", picture(1, 64, 64)],
    "two images": [picture(2, 50, 100), "Compare it with", picture(3, 96, 64), "please."],
    "large, shrunk": [picture(4, 300, 500), "Describe it."],
    "one clip": [clip(1, 0.7), "What is said here?"],
    "image and audio": ["Does", clip(2, 0.45), "describe", picture(5, 40, 80), "?"],
    "text only": ["Tell me about a paged KV cache and sliding windows."],
}


def ours(parts, params=GREEDY) -> RequestSpec:
    content = [{"type": "text", "text": p} if isinstance(p, str) else audio_part(p.raw) if isinstance(p, clip) else
               {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    return RequestSpec(messages=({"role": "user", "content": content},), params=params)


def reference_inputs(processor, parts):
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "audio" if isinstance(p, clip) else
                                                                        "image"} for p in parts]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    images = [p for p in parts if not isinstance(p, (str, clip))]
    audio = [p.samples for p in parts if isinstance(p, clip)]
    return processor(text=[text], images=images or None, audio=audio or None, return_tensors="pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gemma4_vlm(tmp_path_factory.mktemp("gemma4"), seed=19)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_processor(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Gemma4ForConditionalGeneration

    model, info = Gemma4ForConditionalGeneration.from_pretrained(str(checkpoint), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return model.float().eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    model = LLM(str(checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
                max_num_batched_tokens=16)
    yield model
    model.close()


@pytest.mark.parametrize("size", [(64, 64), (100, 50), (30, 200)])
def test_vision_features_equal_transformers(llm, processor, reference, size):
    img = picture(5, *size)
    ref = processor.image_processor(images=[img], return_tensors="pt")
    with torch.no_grad():
        (expected,) = reference.model.get_image_features(ref["pixel_values"], ref["image_position_ids"]).pooler_output
    encoded = llm.deployment.runtime.encoders["image"].encode(MediaItem("image", b"", img))
    assert encoded.embeds.shape == expected.shape
    assert (encoded.embeds - expected).abs().max() <= 1e-4
    assert encoded.importance.shape == (expected.shape[0],)


@pytest.mark.parametrize("seconds", [0.2, 0.77, 1.5])
def test_audio_features_equal_transformers(llm, processor, reference, seconds):
    samples = clip(7, seconds).samples
    ref = processor.feature_extractor([samples], return_tensors="pt")
    with torch.no_grad():
        out = reference.model.get_audio_features(ref["input_features"], ref["input_features_mask"])
    expected = out.pooler_output[0][out.attention_mask[0]]
    encoded = llm.deployment.runtime.encoders["audio"].encode(MediaItem("audio", b"", samples))
    assert encoded.embeds.shape == expected.shape
    assert (encoded.embeds - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_and_first_step_logits_equal_transformers(llm, processor, reference, name):
    runtime = llm.deployment.runtime
    inputs = reference_inputs(processor, PROMPTS[name])
    prepared = runtime.prepare(ours(PROMPTS[name]))
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = reference(**inputs).logits[0, -1]
    assert (paged_first_step_logits(runtime, prepared) - expected).abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(llm, processor, reference):
    assert_greedy_equals_generate(llm, reference, PROMPTS, ours, lambda parts: reference_inputs(processor, parts))
    assert trace(alone(llm, ours(["What is in this picture?", picture(9, 64, 64)]))) != trace(
        alone(llm, ours(PROMPTS["one image"])))


def test_image_requests_join_mid_flight_and_match_their_output_alone(llm):
    # the founder runs long enough that the batch is still running while each later request's media are encoded
    assert_media_joins_equal_alone(llm, PROMPTS, ours, founder_tokens=96)


def test_chat_endpoint_answers_image_url_and_input_audio_parts_as_transformers(llm, processor, reference):
    from ifb.server import app as app_module

    app = app_module.build_app(llm.deployment)

    async def post(content):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/v1/chat/completions", json={
                "model": llm.deployment.runtime.model_name, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": content}]})

    for name in ("one image", "one clip"):
        parts = PROMPTS[name]
        inputs = reference_inputs(processor, parts)
        with torch.no_grad():
            out = reference.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None)
        expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        good = asyncio.run(post(list(ours(parts).messages[0]["content"])))
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["message"]["content"] == expected, name
        assert good.json()["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    bad = asyncio.run(post([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]))
    assert bad.status_code == 400 and "not an image" in bad.text
    garbled = asyncio.run(post([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]))
    assert garbled.status_code == 400


def test_bidirectional_vision_attention_is_refused_naming_the_field(checkpoint, tmp_path):
    import json
    import shutil

    from ifb_plugins.vlm.families import load_vlm

    shutil.copytree(checkpoint, tmp_path / "bidir")
    cfg = json.loads((tmp_path / "bidir" / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = "vision"
    (tmp_path / "bidir" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_vlm(tmp_path / "bidir")
