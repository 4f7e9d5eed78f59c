"""Qwen2.5-VL served through ``LLM(plugin="vlm")`` against transformers on the same tiny random checkpoint:
prompts, first-step logits, greedy tokens, batched == alone with media joining mid-flight, the pruner."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from ifb import LLM, SamplingParams
from ifb.params import InvalidRequest
from tests.plugins.vlm.tiny_qwen2_5_vl import IMAGE_TOKEN_ID, load_processor, save_tiny_qwen2_5_vl

from tests.helpers import submit_staggered
from tests.media_family import (
    NUM_TOKENS, alone, assert_greedy_equals_generate, assert_media_joins_equal_alone, data_url, image_inputs,
    image_request, paged_first_step_logits, picture, trace)

import transformers

#: name -> content parts: text (str) and images (PIL), in order
PROMPTS = {
    "one image": ["What is in this picture?", picture(1, 56, 56)],
    "two images": [picture(2, 50, 90), "Compare it with", picture(3, 84, 56), "please."],
    "non-square, shrunk": [picture(4, 300, 500), "Describe it."],
    "tall, partial windows": ["Look:", picture(5, 211, 57)],
    "text only": ["Tell me about a paged KV cache."],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), seed=11)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_processor(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(checkpoint)).eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    # A 16-token budget splits the media spans across prefill chunks.
    model = LLM(str(checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
                max_num_batched_tokens=16)
    yield model
    model.close()


@pytest.fixture(scope="module")
def pruned(checkpoint):
    model = LLM(str(checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
                max_num_batched_tokens=16, visual_token_pruner=0.5)
    yield model
    model.close()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_and_first_step_logits_equal_transformers(llm, processor, reference, name):
    runtime = llm.deployment.runtime
    inputs = image_inputs(processor, PROMPTS[name])
    prepared = runtime.prepare(image_request(PROMPTS[name]))
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()  # the template, the placeholder expansion
    with torch.no_grad():
        expected = reference(**inputs).logits[0, -1]
    assert (paged_first_step_logits(runtime, prepared) - expected).abs().max() <= 1e-4


def test_greedy_tokens_equal_transformers_generate(llm, processor, reference):
    assert_greedy_equals_generate(llm, reference, PROMPTS, image_request, lambda parts: image_inputs(processor, parts))
    # the pictures reach the decoder: another image changes the answer's log-probabilities
    other = ["What is in this picture?", Image.new("RGB", (56, 56), (250, 10, 10))]
    assert trace(alone(llm, image_request(other))) != trace(alone(llm, image_request(PROMPTS["one image"])))


def test_media_requests_join_mid_flight_and_match_their_output_alone(llm):
    # the founder runs long enough that the batch is still running while each later request's media are encoded
    assert_media_joins_equal_alone(llm, PROMPTS, image_request, founder_tokens=128)


def test_pruner_keeps_the_ratio_of_visual_tokens_with_their_grid_positions(llm, pruned):
    spec = image_request(PROMPTS["two images"])
    full = llm.deployment.runtime.prepare(spec)
    kept = pruned.deployment.runtime.prepare(spec)
    count = lambda p: p.prompt_token_ids.count(IMAGE_TOKEN_ID)  # noqa: E731
    assert count(kept) == sum(-(-n // 2) for n in (6, 6)) and count(full) == 12
    assert len(full.prompt_token_ids) - len(kept.prompt_token_ids) == 6
    result = alone(pruned, spec)
    assert result.num_prompt_tokens == len(kept.prompt_token_ids)


def test_under_the_pruner_media_founds_a_batch_while_text_joins(pruned):
    long_text = image_request(["Tell me a long story."], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
    joiner = image_request(["Short question?"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    media = image_request(PROMPTS["non-square, shrunk"])
    media_alone = trace(alone(pruned, media))
    before = pruned.health()["scheduling"]
    results = submit_staggered(pruned.engine, [long_text, joiner, media], gap_steps=2)
    after = pruned.health()["scheduling"]
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] == 1  # the text joiner only
    assert after["stalls_incompatible"] > before["stalls_incompatible"]  # the media head waited
    assert trace(results[2]) == media_alone
    assert pruned.deployment.caps.options["media_under_pruner"].support.value == "founder-only"


def test_an_image_too_elongated_for_the_processor_is_refused(llm):
    with pytest.raises(InvalidRequest, match="aspect ratio"):
        llm.engine.submit(image_request(["Look:", picture(0, 2, 500)]))


def test_a_heavily_pruned_image_may_place_text_past_its_context_index(pruned):
    """Kept tokens keep their grid ids, so 2 of a 3x6 grid's tokens still span 6 columns: ids run ahead."""
    runtime = pruned.deployment.runtime
    spec = image_request(PROMPTS["non-square, shrunk"])
    runtime.pruner_ratio = 0.1
    try:
        prepared = runtime.prepare(spec)
        result = alone(pruned, spec)
    finally:
        runtime.pruner_ratio = 0.5
    assert prepared.prompt_token_ids.count(IMAGE_TOKEN_ID) == 2
    assert prepared.state.media.positions.delta > 0
    assert len(result.token_ids) == NUM_TOKENS


def test_blocking_path_and_context_reuse_keep_the_mrope_positions(checkpoint, llm):
    """A prefix leased from the cache was computed at the same ids; the blocking path uses them too."""
    long_prompt = ["A long shared preamble about paged attention and block tables. " * 3, picture(1, 56, 56),
                   "What is in this picture?"]
    specs = [image_request(long_prompt), image_request(PROMPTS["two images"]), image_request(long_prompt)]
    expected = [trace(alone(llm, s)) for s in specs]
    with LLM(str(checkpoint), plugin="vlm", enable_in_flight_batching=True, enable_context_reuse=True) as cached:
        got = [trace(alone(cached, s)) for s in specs]
        hits = cached.health()["prefix_cache"]["hits"]
    assert got == expected and hits >= 1
    with LLM(str(checkpoint), plugin="vlm") as blocking:
        assert not blocking.engine.is_in_flight
        assert trace(blocking.engine.submit(specs[1]).result()) == expected[1]


def test_ifb_serve_answers_as_transformers_generates(checkpoint, processor, reference, tmp_path):
    """``ifb serve --plugin vlm DIR`` with the official ``openai`` client: the greedy answer to a two-image chat."""
    import os
    import subprocess
    import sys
    import time

    import httpx
    import openai

    from tests.plugins.vlm.test_serve import _free_port

    parts = PROMPTS["two images"]
    inputs = image_inputs(processor, parts)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "ifb", "serve", str(checkpoint), "--plugin", "vlm", "--enable-in-flight-batching",
         "--max-batch-size", "2", "--port", str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        content = image_request(parts).messages[0]["content"]
        reply = client.chat.completions.create(model=checkpoint.name, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True},
                                               messages=[{"role": "user", "content": content}])
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
        with pytest.raises(openai.BadRequestError, match="aspect ratio"):
            client.chat.completions.create(model=checkpoint.name, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture(0, 2, 500))}}]}])
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
