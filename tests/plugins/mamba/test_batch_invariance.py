"""Batched == alone, bit for bit: what ``batch_invariant_verified=True`` promises for the mamba plugin,
for every family it loads (Nemotron-H, Bamba, Granite 4.0 hybrid).

Requests arrive staggered, join mid-flight and prefill in 8-token chunks
beside decoding batch mates; each must produce exactly the tokens it
produces alone on the blocking path (one-shot prefill, nobody else in the
batch).
"""

from __future__ import annotations

import pytest
import torch

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams
from tests.helpers import submit_staggered

PROMPT_LENS = (5, 17, 9, 23, 2, 13, 30, 11)
MAX_TOKENS = (12, 7, 10, 5, 14, 8, 6, 9)
SAMPLED = {2: 11, 5: 12}  # request index -> seed: seeded sampling is per row, so it is invariant too


def _specs() -> list[RequestSpec]:
    gen = torch.Generator().manual_seed(7)
    specs = []
    for i, (n, max_tokens) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
        ids = tuple(torch.randint(3, 300, (n,), generator=gen).tolist())
        # Logprobs come from the raw logits, so comparing them checks the logits bit for bit,
        # not just the argmax (which would hide last-bit differences).
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        if i in SAMPLED:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=SAMPLED[i], max_tokens=max_tokens,
                                    ignore_eos=True, logprobs=2)
        specs.append(RequestSpec(prompt_token_ids=ids, params=params))
    return specs


SPECS = _specs()


def _bits(result) -> tuple:
    """The tokens and their logprobs (chosen and top alternatives), as exact floats."""
    return result.token_ids, tuple((lp.token_id, lp.logprob, lp.top_logprobs) for lp in result.logprobs)


@pytest.fixture(scope="module", params=["nemotron_h", "bamba", "granitemoehybrid"])
def family_dir(request, family_dirs):
    return family_dirs[request.param]


@pytest.fixture(scope="module")
def alone(family_dir) -> list[tuple]:
    """Each request on the blocking path: one request at a time, whole-prompt prefill."""
    with LLM(model=str(family_dir), plugin="mamba") as llm:
        assert not llm.engine.is_in_flight
        return [_bits(llm.engine.submit(spec).result()) for spec in SPECS]


def _record_steps(llm) -> list:
    runtime, steps = llm.deployment.runtime, []
    execute = runtime.execute

    def recording(step):
        steps.append(step)
        return execute(step)

    runtime.execute = recording
    return steps


def test_staggered_chunked_batch_equals_each_request_alone(family_dir, alone):
    with LLM(model=str(family_dir), plugin="mamba", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=8) as llm:
        steps = _record_steps(llm)
        results = submit_staggered(llm.engine, SPECS, gap_steps=2)
        scheduling = llm.health()["scheduling"]
    assert [_bits(r) for r in results] == alone
    assert [len(r.token_ids) for r in results] == list(MAX_TOKENS)
    assert scheduling["admitted_mid_flight"] > 0
    # Prompts were split into chunks, and some chunk was prefilled beside decoding batch mates.
    num_prompt = {n.request_id: n.num_prompt_tokens for step in steps for n in step.new_seqs}
    assert any(0 < s.start_pos < num_prompt[s.request_id] for step in steps for s in step.seqs)
    assert any(any(len(s.token_ids) > 1 for s in step.seqs) and any(len(s.token_ids) == 1 and s.start_pos >=
               num_prompt[s.request_id] for s in step.seqs) for step in steps)


def test_a_cancelled_request_leaves_no_state_in_its_seat(family_dir, alone):
    with LLM(model=str(family_dir), plugin="mamba", enable_in_flight_batching=True, max_batch_size=2,
             max_num_batched_tokens=8) as llm:
        steps = _record_steps(llm)
        runtime = llm.deployment.runtime
        doomed = llm.engine.submit(RequestSpec(prompt_token_ids=SPECS[6].prompt_token_ids, params=SamplingParams(
            temperature=0.0, max_tokens=200, ignore_eos=True)))
        outputs = iter(doomed)
        next(outputs), next(outputs)  # it is decoding: its seat holds a live state
        doomed.cancel()
        assert [o.finish_reason for o in outputs][-1] == "cancelled"
        seat = next(s.seat for step in steps for s in step.seqs if s.request_id == doomed.request_id)
        conv, ssm = runtime.seat_state(seat)
        assert all(not t.any() for t in conv + ssm)

        result = llm.engine.submit(SPECS[3]).result()
        reused = {s.seat for step in steps for s in step.seqs if s.request_id == result.request_id}
    assert reused == {seat}
    assert _bits(result) == alone[3]
