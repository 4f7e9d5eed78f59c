"""The real default model (SmolLM2-135M-Instruct) through the Python API."""

from __future__ import annotations

import pytest

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec

from tests.helpers import submit_staggered

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The quick brown fox", "Once upon a time, in a land far away, there lived", "def fibonacci(n):",
    "What is 2+2? The answer is", "Paris is the capital of", "List three colors:", "In 1492, Columbus",
    "The meaning of life is",
]


@pytest.fixture(scope="module")
def llm():
    model = LLM(enable_in_flight_batching=True, max_batch_size=8, max_num_batched_tokens=32)
    yield model
    model.close()


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in out.text


def test_staggered_batch_gives_each_prompt_its_solo_greedy_tokens(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    alone = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    before = llm.health()["scheduling"]["admitted_mid_flight"]
    results = submit_staggered(llm.engine, [RequestSpec(prompt=p, params=params) for p in PROMPTS])
    assert [r.token_ids for r in results] == alone
    assert llm.health()["scheduling"]["admitted_mid_flight"] > before


def test_streaming_is_valid_utf8_text(llm):
    chunks = list(llm.stream(messages=[{"role": "user", "content": "Write the word café and an emoji."}],
                             params=SamplingParams(temperature=0.0, max_tokens=30)))
    text = "".join(c.text for c in chunks)
    # multi-byte characters split across tokens never stream as replacement characters; only a
    # generation cut by max_tokens inside a character may end with one, as a full decode does
    assert "\ufffd" not in text.rstrip("\ufffd") and "é" in text
    assert text == llm.tokenizer.decode(
        [t for c in chunks for t in c.token_ids if t not in llm.tokenizer.eos_token_ids])
