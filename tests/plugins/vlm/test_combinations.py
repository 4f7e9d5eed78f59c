"""vlm combinations the matrix declares served, each run under in-flight batching with staggered arrivals.

Differing sampling parameters share a batch with media requests (a seeded sampled request gets what it
gets alone); the visual-token pruner and the context cache together (media still found their batch,
text joins, a repeated image reuses its blocks, and every output equals the pruned deployment's
without the cache).
"""

from __future__ import annotations

import pytest

from ifb import LLM, SamplingParams
from tests.helpers import submit_staggered
from tests.plugins.vlm.compare import alone, trace
from tests.plugins.vlm.test_runtime import image_chat, text_chat

SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=77, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(vlm_checkpoint):
    with LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16) as model:
        yield model


def test_differing_sampling_parameters_share_a_batch_with_media(llm):
    target = image_chat(2, params=SEEDED)
    expected = llm.engine.submit(target, wait=True).result().token_ids
    # the first runs long enough that the others join it mid-flight
    mates = [image_chat(3, params=SamplingParams(temperature=1.0, top_k=5, max_tokens=64, ignore_eos=True)),
             text_chat("Hello there", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
             image_chat(4, params=SamplingParams(temperature=0.4, top_p=0.5, max_tokens=6, ignore_eos=True))]
    stalls = llm.health()["scheduling"]["stalls_incompatible"]
    results = submit_staggered(llm.engine, [mates[0], mates[1], target, mates[2]], gap_steps=1, min_joined=2)
    assert results[2].token_ids == expected
    assert llm.health()["scheduling"]["stalls_incompatible"] == stalls  # nobody waited for its parameters


def test_pruner_and_context_cache_together(vlm_checkpoint):
    settings = dict(plugin="vlm", enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16,
                    visual_token_pruner=0.25)
    long_text = text_chat("Tell me a long story.", SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True))
    joiner = text_chat("Tell me a story.", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    media = [image_chat(1), image_chat(2)]
    with LLM(str(vlm_checkpoint), **settings) as plain:
        expected = [trace(alone(plain, spec)) for spec in (joiner, *media)]
    with LLM(str(vlm_checkpoint), enable_context_reuse=True, **settings) as cached:
        assert trace(alone(cached, media[0])) == expected[1]  # publishes image 1's blocks
        hits = cached.health()["prefix_cache"]["hits"]
        results = submit_staggered(cached.engine, [long_text, joiner, *media], gap_steps=2)
        health = cached.health()
    assert [trace(r) for r in results[1:]] == expected
    assert health["prefix_cache"]["hits"] > hits  # the repeated image (and the shared chat prefix) reused
    assert health["scheduling"]["stalls_incompatible"] > 0  # media under the pruner founded their batch
