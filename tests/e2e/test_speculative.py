"""Speculative decoding on the real default model: greedy output bit-identical with and without drafts,
alone and in a busy batch with mid-flight joins and preemption, for n-gram lookup and the model's own GGUF
drafting on the int8-activation kernels."""

from __future__ import annotations

import pytest

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from tests.helpers import submit_staggered

pytestmark = pytest.mark.e2e

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
MESSAGES = [
    [{"role": "user", "content": "Write a short story about a cat."}],
    [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}],
    [{"role": "user", "content": f"Rename sub to minus in:\n{CODE}"}],
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40)
#: three staggered requests (each joins the running batch) growing past 240 tokens of KV: one is preempted
BUSY = dict(enable_in_flight_batching=True, max_batch_size=3, max_num_batched_tokens=32, max_kv_cache_capacity=240)


def outputs(llm: LLM, busy: bool) -> list[tuple[int, ...]]:
    specs = [RequestSpec(messages=tuple(m), params=PARAMS) for m in MESSAGES]
    if busy:
        return [r.token_ids for r in submit_staggered(llm.engine, specs, gap_steps=1)]
    return [llm.engine.submit(s).result().token_ids for s in specs]


@pytest.fixture(scope="module")
def plain() -> dict[bool, list]:
    with LLM() as llm:
        alone = outputs(llm, False)
    with LLM(**BUSY) as llm:
        busy = outputs(llm, True)
        assert llm.health()["scheduling"]["preempted"] > 0
    return {False: alone, True: busy}


@pytest.mark.parametrize("source", ["ngram", "int8-draft"])
def test_greedy_output_is_bit_identical_with_drafts(plain, source):
    options = dict(speculative_method="ngram") if source == "ngram" else \
        dict(speculative_model="smollm2-135m-instruct", speculative_quantization="int8")
    with LLM(speculative_policy="always", **options) as llm:
        assert outputs(llm, False) == plain[False]
        alone = llm.health()["speculative_decoding"]
    with LLM(**BUSY, speculative_policy="always", **options) as llm:
        assert outputs(llm, True) == plain[True]
        health = llm.health()
    assert alone["accepted"] > 0 and health["speculative_decoding"]["accepted"] > 0
    assert health["scheduling"]["preempted"] > 0 and health["scheduling"]["admitted_mid_flight"] > 0
