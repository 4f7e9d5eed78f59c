"""The Qwen3-Omni Thinker's image input against transformers on the same tiny weights.

Preprocessing against ``Qwen2VLImageProcessorPil``, the vision encoder (merged
embeddings and DeepStack features) against ``Qwen3OmniMoeVisionEncoder``, the
placeholder expansion against the processor's count, first-step logits (with
``get_rope_index``'s M-RoPE positions) and greedy tokens against the Thinker
with ``pixel_values``, for an image prompt and one with an image and an audio
clip; under in-flight batching, image requests joining a running batch give
their output alone.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.speech.omni_vision import load_image_encoder

from tests.helpers import submit_staggered

from .omni_reference import image_processor, omni_tokenizer
from .test_omni_audio import GREEDY, audio_chat, first_logits, reference_inputs

TOKENIZER = omni_tokenizer()
#: (height, width): a 2x3 merged grid after resizing; a 4x4 one; one resized down to the 32x32 pixel limit
SIZES = ((20, 28), (32, 32), (60, 44))


def png(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_part(seed: int, size: tuple[int, int]) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png(seed, size)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def image_chat(seed: int, size: tuple[int, int], text: str = "Say hi.", params=GREEDY, audio=None) -> RequestSpec:
    parts = [image_part(seed, size), *([audio] if audio else []), {"type": "text", "text": text}]
    return RequestSpec(messages=({"role": "user", "content": parts},), params=params)


def reference_image_inputs(seed: int, size: tuple[int, int], text: str = "Say hi.", audio=None):
    """The processor's ids and tensors for the same chat (the image first, then an optional clip, then text)."""
    image = Image.open(io.BytesIO(png(seed, size)))
    pixels = image_processor()(images=[image], return_tensors="pt")
    count = int(pixels["image_grid_thw"].prod()) // 4
    parts = [{"type": "image"}, *([{"type": "audio"}] if audio else []), {"type": "text", "text": text}]
    prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                           tokenize=False)
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * count)
    inputs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
    if audio:
        ids, features, mask = reference_inputs(*audio)  # the clip's own count, from its own prompt
        num_audio = int((ids == TOKENIZER.convert_tokens_to_ids("<|audio_pad|>")).sum())
        prompt = prompt.replace("<|audio_pad|>", "<|audio_pad|>" * num_audio)
        inputs.update(input_features=features, feature_attention_mask=mask)
    ids = torch.tensor([TOKENIZER(prompt, add_special_tokens=False)["input_ids"]])
    return ids, {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def llm(omni_reference_model):
    with LLM(str(omni_reference_model[0]), plugin="omni", enable_in_flight_batching=True) as llm:
        yield llm


def test_preprocessing_and_vision_encoder_equal_the_reference(omni_reference_model):
    path, model = omni_reference_model
    encoder = load_image_encoder(path, json.loads((path / "config.json").read_text()))
    for seed, size in enumerate(SIZES):
        image = Image.open(io.BytesIO(png(seed, size)))
        ref = image_processor()(images=[image], return_tensors="pt")
        pixels, grid = encoder.processing(image)
        assert grid == tuple(ref["image_grid_thw"][0].tolist())
        assert np.abs(pixels - ref["pixel_values"].numpy()).max() <= 1e-6
        with torch.no_grad():
            expected = model.thinker.get_image_features(ref["pixel_values"], ref["image_grid_thw"])
        merged = torch.cat(list(expected.pooler_output))  # per image
        rows = encoder.encode(image, torch.device("cpu")).rows
        hidden = merged.shape[-1]
        assert rows.shape == (merged.shape[0], 2 * hidden)  # one DeepStack layer
        assert (rows[:, :hidden] - merged).abs().max().item() <= 1e-4
        assert (rows[:, hidden:] - torch.cat(list(expected.deepstack_features[0]))).abs().max().item() <= 1e-4


@pytest.mark.parametrize("size, audio", [(SIZES[0], None), (SIZES[2], (3, 2.37))], ids=["image", "image+audio"])
def test_prompt_logits_and_greedy_tokens_equal_the_thinker(omni_reference_model, llm, size, audio):
    _, model = omni_reference_model
    clip = audio_chat(*audio).messages[0]["content"][0] if audio else None
    spec = image_chat(3, size, audio=clip)
    ids, inputs = reference_image_inputs(3, size, audio=audio)
    prepared = llm.deployment.runtime.prepare(spec)
    assert list(prepared.prompt_token_ids) == ids[0].tolist()  # the processor's expansion
    with torch.no_grad():
        expected = model.thinker(**inputs).logits[0, -1]
        generated = model.thinker.generate(**inputs, do_sample=False, max_new_tokens=6, eos_token_id=None,
                                           pad_token_id=0)
    assert (first_logits(llm.deployment.runtime, prepared) - expected).abs().max().item() <= 1e-4
    ours = llm.engine.submit(spec, wait=True).result()
    assert list(ours.token_ids) == generated[0, ids.shape[1]:].tolist()


def test_image_requests_join_a_running_batch_with_their_output_alone(llm):
    long_text = RequestSpec(messages=({"role": "user", "content": "Hello there, how are you?"},),
                            params=SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
    clip = audio_chat(2, 0.3).messages[0]["content"][0]
    specs = [long_text, image_chat(1, SIZES[0]), image_chat(2, SIZES[1], audio=clip), audio_chat(4, 2.37),
             image_chat(5, SIZES[2], "Hello there")]
    solo = [llm.engine.submit(s, wait=True).result().token_ids for s in specs]
    before = llm.health()["scheduling"]
    batched = submit_staggered(llm.engine, specs, gap_steps=2)
    after = llm.health()["scheduling"]
    assert [r.token_ids for r in batched] == solo
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] >= 4
    assert after["stalls_incompatible"] == before["stalls_incompatible"]
    runtime = llm.deployment.runtime  # the image is seen: another image moves the logits
    seen = first_logits(runtime, runtime.prepare(image_chat(1, SIZES[0]))) - first_logits(
        runtime, runtime.prepare(image_chat(6, SIZES[0])))
    assert seen.abs().max().item() > 1e-3
