"""The legacy system-prompt capture under in-flight batching: the context cache keeps the captured prefix."""

from __future__ import annotations

import pytest

from ifb import LLM, SamplingParams
from ifb.engine import RequestRejected
from ifb.params import RequestSpec
from tests.models.text import save_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You are a terse assistant that answers in one word. " * 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("capture"), "llama", seed=2)


def chat(user: str, **extras) -> RequestSpec:
    return RequestSpec(messages=[SYSTEM, {"role": "user", "content": user}], params=GREEDY, extras=extras)


def test_a_captured_system_prompt_is_computed_once(checkpoint):
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=4, enable_context_reuse=True,
             max_kv_cache_capacity=16 * 40) as llm:
        engine, runtime = llm.engine, llm.deployment.runtime
        system_len = len(runtime.tokenizer.encode(runtime.tokenizer.apply_chat_template(
            [SYSTEM], add_generation_prompt=False), add_special_tokens=False))
        pinned = system_len - system_len % 16
        assert pinned >= 32
        captured = engine.submit(chat("first", save_system_prompt_kv_cache=True), wait=True).result()
        assert len(engine.prefix.pinned) == pinned // 16
        # other prompts fill the cache and push everything unpinned out
        for i in range(12):
            engine.submit(RequestSpec(prompt_token_ids=tuple(range(40 + i, 100 + i)), params=GREEDY), wait=True).result()
        assert engine.counters.prefix_cache_evictions > 0
        second = chat("second question")
        num_prompt = len(runtime.prepare(second).prompt_token_ids)
        before = engine.counters.computed_prompt_tokens
        out = engine.submit(second, wait=True).result()
        # the second request computes only its own tokens past the captured blocks
        assert engine.counters.computed_prompt_tokens - before == num_prompt - pinned
        assert out.num_prompt_tokens == num_prompt and captured.finish_reason == "length"
        reference = LLM(str(checkpoint))
        try:
            assert out.token_ids == reference.engine.submit(second, wait=True).result().token_ids
        finally:
            reference.close()


def test_without_the_context_cache_the_capture_is_rejected_with_the_reason(checkpoint):
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=2) as llm:
        with pytest.raises(RequestRejected, match="publishes the system prompt into the context cache.*"
                                                  "--enable-context-reuse"):
            llm.engine.submit(chat("x", save_system_prompt_kv_cache=True))
