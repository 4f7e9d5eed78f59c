"""Omni combinations the matrix declares served, each run under in-flight batching with staggered arrivals.

Differing sampling parameters share the Thinker's batch with media requests (a seeded sampled request
gets what it gets alone); a guided request with an image joins a running batch and is both in its
language and what it is alone; with the context cache, requests sharing a system prompt (text, image,
audio) reuse its blocks and every output equals the deployment's without the cache.
"""

from __future__ import annotations

import re

import attrs
import pytest

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from tests.helpers import submit_staggered

from .test_omni_audio import audio_chat
from .test_omni_image import SIZES, image_chat

SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=11, max_tokens=8, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You are a helpful assistant who always answers in short sentences."}


@pytest.fixture(scope="module")
def llm(omni_reference_model):
    with LLM(str(omni_reference_model[0]), plugin="omni", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16) as model:
        yield model


def text_chat(text: str, params=GREEDY) -> RequestSpec:
    return RequestSpec(messages=({"role": "user", "content": text},), params=params)


def test_differing_sampling_parameters_share_the_thinkers_batch_with_media(llm):
    target = image_chat(3, SIZES[0], params=SEEDED)
    expected = llm.engine.submit(target, wait=True).result().token_ids
    # the first runs long enough that the others join it mid-flight
    mates = [text_chat("Hello there, how are you?", SamplingParams(temperature=1.0, top_k=5, max_tokens=64,
                                                                    ignore_eos=True)),
             audio_chat(1, 0.3, params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
             image_chat(4, SIZES[1], params=SamplingParams(temperature=0.5, top_p=0.6, max_tokens=6, ignore_eos=True))]
    stalls = llm.health()["scheduling"]["stalls_incompatible"]
    results = submit_staggered(llm.engine, [mates[0], mates[1], target, mates[2]], gap_steps=1, min_joined=2)
    assert results[2].token_ids == expected
    assert llm.health()["scheduling"]["stalls_incompatible"] == stalls


def test_a_guided_media_request_joins_a_running_batch(llm):
    fmt = {"type": "regex", "regex": "[a-z]{2,5}-[0-9]{2}"}
    guided = attrs.evolve(image_chat(5, SIZES[0]), params=SamplingParams(temperature=0.0, max_tokens=12),
                          extras={"response_format": fmt})
    expected = llm.engine.submit(guided, wait=True).result()
    assert re.fullmatch(fmt["regex"], expected.text)
    long_text = text_chat("Hello there, how are you?", SamplingParams(temperature=0.0, max_tokens=64,
                                                                       ignore_eos=True))
    stalls = llm.health()["scheduling"]["stalls_guided"]
    results = submit_staggered(llm.engine, [long_text, guided, audio_chat(2, 0.3)], gap_steps=2, min_joined=2)
    assert results[1].token_ids == expected.token_ids and re.fullmatch(fmt["regex"], results[1].text)
    assert llm.health()["scheduling"]["stalls_guided"] == stalls


def with_system(spec: RequestSpec) -> RequestSpec:
    return attrs.evolve(spec, messages=(SYSTEM, *spec.messages))


def test_the_context_cache_reuses_a_shared_system_prompt_across_media(omni_reference_model):
    path = str(omni_reference_model[0])
    specs = [with_system(s) for s in (text_chat("Hello there, how are you?", SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True)), image_chat(1, SIZES[0]), audio_chat(3, 0.3),
        text_chat("Say hi."), image_chat(1, SIZES[0]))]
    settings = dict(plugin="omni", enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    with LLM(path, **settings) as plain:
        expected = [plain.engine.submit(s, wait=True).result().token_ids for s in specs]
    with LLM(path, enable_context_reuse=True, **settings) as cached:
        assert cached.engine.submit(specs[0], wait=True).result().token_ids == expected[0]  # publishes
        results = submit_staggered(cached.engine, specs, gap_steps=2, min_joined=2)
        health = cached.health()
    assert [r.token_ids for r in results] == expected
    assert health["prefix_cache"]["hits"] >= 5 * 16  # every request reused at least the system prompt's block
