"""Preemption under a KV pool too small for the batch: a preempted request is recomputed from its
prompt plus the tokens it had generated, and its output is bit for bit the uninterrupted one."""

from __future__ import annotations

import pytest

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from tests.models.text import save_tiny_checkpoint

PROMPTS = [list(range(5 + 3 * i, 5 + 3 * i + n)) for i, n in enumerate([9, 14, 6, 11])]
PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)


def _greedy(tokens, text, logprobs) -> tuple:
    return tuple(tokens), text, [lp.logprob for lp in logprobs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture(scope="module")
def alone(checkpoint):
    with LLM(str(checkpoint)) as llm:
        results = [llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=PARAMS)).result() for p in PROMPTS]
    return [_greedy(r.token_ids, r.text, r.logprobs) for r in results]


@pytest.mark.parametrize("reuse", [False, True], ids=["recompute", "context-cache"])
def test_a_preempted_request_streams_exactly_its_uninterrupted_output(checkpoint, alone, reuse):
    # 80 tokens of KV for four answers of ~40 tokens each: the youngest residents must leave
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16,
             max_kv_cache_capacity=80, enable_context_reuse=reuse) as llm:
        handles = [llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=PARAMS)) for p in PROMPTS]
        streamed = []
        for handle in handles:
            outs = list(handle)
            tokens = [t for o in outs for t in o.token_ids]
            logprobs = [lp for o in outs for lp in o.logprobs]
            streamed.append(_greedy(tokens, "".join(o.text for o in outs), logprobs))
        health = llm.health()
    scheduling = health["scheduling"]
    assert scheduling["preempted"] > 0
    assert scheduling["completed"] == len(PROMPTS) and scheduling["resident"] == scheduling["queued"] == 0
    # every token and every piece of text arrived once, in order, as if the request was never interrupted
    assert [(tokens, text) for tokens, text, _ in streamed] == [(tokens, text) for tokens, text, _ in alone]
    # the logprobs agree to float32 summation order (batch mates change a matmul's row count)
    for (_, _, got), (_, _, want) in zip(streamed, alone):
        assert got == pytest.approx(want, abs=1e-5)
    if reuse:
        assert health["prefix_cache"]["hits"] > 0  # blocks a preempted request had published came back
