"""Preemption under a KV pool too small for the batch: a preempted request's attention KV and its
recurrent state are both recomputed from prompt + generated tokens, bit for bit as if uninterrupted."""

from __future__ import annotations

import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams

PROMPT_LENS = (9, 14, 6, 11)
#: logprobs come from the raw logits: equal logprobs mean the recomputed state is the same to the bit
PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)


def _specs() -> list[RequestSpec]:
    gen = torch.Generator().manual_seed(3)
    return [RequestSpec(prompt_token_ids=tuple(torch.randint(3, 300, (n,), generator=gen).tolist()), params=PARAMS)
            for n in PROMPT_LENS]


def _bits(tokens, text, logprobs) -> tuple:
    return tuple(tokens), text, tuple((lp.token_id, lp.logprob, lp.top_logprobs) for lp in logprobs)


def test_a_preempted_request_recomputes_its_state_and_streams_its_uninterrupted_output(hybrid_dir):
    specs = _specs()
    with LLM(model=str(hybrid_dir), plugin="mamba") as llm:
        alone = [_bits(r.token_ids, r.text, r.logprobs) for r in (llm.engine.submit(s).result() for s in specs)]
    # 80 tokens of KV for four answers of ~40 tokens each: the youngest residents must leave
    with LLM(model=str(hybrid_dir), plugin="mamba", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16, max_kv_cache_capacity=80) as llm:
        handles = [llm.engine.submit(s) for s in specs]
        streamed = []
        for handle in handles:
            outs = list(handle)
            streamed.append(_bits([t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                                  [lp for o in outs for lp in o.logprobs]))
        scheduling = llm.health()["scheduling"]
    assert scheduling["preempted"] > 0 and scheduling["completed"] == len(specs)
    assert streamed == alone  # each token once, in order; the logits to the bit
