"""Speculative decoding in the engine, model-free: drafts planned under the budget, verified tokens appended
with stops judged token by token, rejected drafts' blocks freed, the policy, the counters."""

from __future__ import annotations

import time

import attrs
import pytest

from ifb.capabilities import DeployConfig
from ifb.engine import RequestEngine
from ifb.params import RequestSpec, SamplingParams
from ifb.runtime import SampledToken, ScheduledStep, SeqOutput, StepOutput
from ifb.speculative import (
    DraftStats, SpeculationCaps, SpeculationCounters, SpeculationPolicy, check_max_num_drafts,
)
from tests.core.fakes import FakeRuntime, next_token, text_caps
from tests.helpers import submit_staggered


@attrs.define
class SpeculatingRuntime(FakeRuntime):
    """Drafts ``next_token``'s own continuation, wrong at every ``wrong_every``-th draft; verifies as a
    greedy target would: drafts accepted while they equal its token, then its own next token."""

    wrong_every: int = 3
    fail_drafts_for: set = attrs.field(factory=set)
    num_drafted: int = 0

    def execute(self, step: ScheduledStep) -> StepOutput:
        time.sleep(0.002)  # a step takes time, so staggered requests arrive mid-flight
        self.steps.append(step)
        seats = self.seats.apply(step)
        outs = []
        for seq, seat in zip(step.seqs, seats):
            # the blocks cover every position the step may compute, drafts included
            assert len(seat.block_ids) * self.kv_block_size >= seq.start_pos + len(seq.token_ids) + seq.num_draft_tokens
            if not seq.is_sampling:
                outs.append(SeqOutput(seq.request_id, None))
                continue
            history = list(seat.token_ids)
            if seq.num_draft_tokens and seq.request_id in self.fail_drafts_for:
                outs.append(SeqOutput(seq.request_id, next_token(tuple(history)),
                                      speculation_error="RuntimeError: injected"))
                continue
            drafts = []
            for j in range(seq.num_draft_tokens):
                self.num_drafted += 1
                token = next_token(tuple(history + drafts))
                drafts.append(token + 1 if self.num_drafted % self.wrong_every == 0 else token)
            accepted = []
            for d in drafts:
                target = next_token(tuple(history + accepted))
                if d != target:
                    break
                accepted.append(d)
            self.seats.accept(seq.request_id, accepted)
            outs.append(SeqOutput(seq.request_id, next_token(tuple(history + accepted)), -0.5 if seat.params.logprobs
                                  is not None else None, accepted=tuple(SampledToken(t, -0.5 if seat.params.logprobs
                                  is not None else None) for t in accepted), num_drafted=len(drafts)))
        return StepOutput(tuple(outs))


def speculating(k: int = 4, **policy) -> SpeculatingRuntime:
    caps = text_caps(speculation=SpeculationCaps("test", k, SpeculationPolicy(**policy)))
    return SpeculatingRuntime(caps=caps)


def engine(runtime, in_flight=True, **config) -> RequestEngine:
    return RequestEngine(runtime, DeployConfig(enable_in_flight_batching=in_flight, **config), [], in_flight=in_flight)


PROMPTS = ["hello", "speculative", "decoding under in flight batching", "abc", "zz"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=0)


def outputs(eng, specs):
    results = submit_staggered(eng, specs, min_joined=0)  # the test that needs joins asserts them
    eng.shutdown()
    return [(r.token_ids, r.text, r.finish_reason) for r in results]


@pytest.mark.parametrize("in_flight", [True, False], ids=["in-flight", "blocking"])
def test_drafted_output_is_the_plain_output_with_joins_and_preemption(in_flight):
    specs = [RequestSpec(prompt=p, params=GREEDY) for p in PROMPTS]
    plain = outputs(engine(FakeRuntime(step_delay=0.002), in_flight, max_batch_size=4), specs)
    runtime = speculating(is_always=True)
    runtime.num_kv_blocks = 16  # 64 tokens for ~190: residents are preempted
    eng = engine(runtime, in_flight, max_batch_size=4, max_num_batched_tokens=16)
    got = outputs(eng, specs)
    assert got == plain
    c = eng.counters
    assert c.is_consistent() and c.speculation.accepted > 0 and c.speculation.drafted > c.speculation.accepted
    if in_flight:
        assert c.preempted > 0 and c.admitted_mid_flight > 0
        # several seats' drafts in one step, beside a prefill chunk
        assert any(sum(s.num_draft_tokens > 0 for s in st.seqs) > 1 for st in runtime.steps)
        assert any(any(s.num_draft_tokens for s in st.seqs) and any(len(s.token_ids) > 1 for s in st.seqs)
                   for st in runtime.steps)
    assert eng.blocks.num_free == eng.blocks.num_blocks  # every block came back, rejected drafts' included
    assert all(st.num_tokens <= 16 for st in runtime.steps)  # drafts are under the token budget


def test_the_runtime_table_drops_what_the_engine_freed():
    runtime = speculating(is_always=True)
    runtime.kv_block_size = 2
    eng = engine(runtime, False)
    eng.submit(RequestSpec(prompt="ab", params=GREEDY)).result()
    eng.shutdown()
    assert any(s.num_dropped_blocks for st in runtime.steps for s in st.seqs)
    # each step's table is exactly the scheduler's (the fake asserts coverage; here: never more blocks than asked)
    for st in runtime.steps:
        for s in st.seqs:
            assert s.num_draft_tokens <= 4


@pytest.mark.parametrize("stop", [{"stop": ("q",)}, {"max_tokens": 7}, {"stop_token_ids": (9,)}])
def test_no_drafted_token_past_a_stop_is_emitted(stop):
    params = attrs.evolve(GREEDY, **stop)
    specs = [RequestSpec(prompt=p, params=params) for p in PROMPTS]
    plain = outputs(engine(FakeRuntime()), specs)
    got = outputs(engine(speculating(is_always=True)), specs)
    assert got == plain
    if "max_tokens" in stop:
        assert all(len(tokens) == 7 for tokens, _, _ in got)


def test_a_draft_failure_ends_only_that_requests_drafting():
    runtime = speculating(is_always=True)
    runtime.fail_drafts_for = {"bad"}
    eng = engine(runtime)
    bad = eng.submit(RequestSpec(prompt="hello", params=GREEDY, request_id="bad"))
    good = eng.submit(RequestSpec(prompt="hello", params=GREEDY, request_id="good"))
    want = outputs(engine(FakeRuntime()), [RequestSpec(prompt="hello", params=GREEDY)])[0][0]
    bad, good = bad.result(), good.result()
    assert bad.token_ids == want and good.token_ids == want and bad.finish_reason == "length"
    eng.shutdown()
    drafted = {s.request_id for st in runtime.steps for s in st.seqs if s.num_draft_tokens}
    assert "good" in drafted
    assert [st for st in runtime.steps if any(s.request_id == "bad" and s.num_draft_tokens for s in st.seqs)] \
        == [runtime.steps[1]]  # asked once, then never again
    assert eng.counters.speculation.draft_failures == 1 and eng.counters.failed == 0


def test_a_request_may_refuse_speculation():
    runtime = speculating(is_always=True)
    eng = engine(runtime)
    eng.submit(RequestSpec(prompt="hello", params=GREEDY, speculative=False, request_id="no")).result()
    eng.shutdown()
    assert not any(s.num_draft_tokens for st in runtime.steps for s in st.seqs)


def test_the_counters_count_by_position_and_show_in_health():
    runtime = speculating(is_always=True)
    eng = engine(runtime)
    eng.submit(RequestSpec(prompt="hello", params=GREEDY)).result()
    health = eng.health()["speculative_decoding"]
    eng.shutdown()
    assert health["method"] == "test" and health["max_num_drafts"] == 4
    assert health["drafted"] == sum(health["drafted_by_position"]) and health["steps_drafted"] > 0
    assert health["accepted"] == sum(health["accepted_by_position"])
    assert 0 < health["acceptance_rate"] < 1
    assert health["drafted_by_position"][0] >= health["drafted_by_position"][-1]


def test_the_policy_drafts_less_for_busier_batches_and_lower_acceptance():
    policy = SpeculationPolicy(position_cost=0.05)
    assert policy.num_drafts(0.9, 8, 1) == 8
    by_seats = [policy.num_drafts(0.8, 8, b) for b in (1, 4, 16, 64)]
    assert by_seats == sorted(by_seats, reverse=True) and by_seats[0] > by_seats[-1]
    by_acceptance = [policy.num_drafts(a, 8, 4) for a in (0.95, 0.7, 0.4, 0.1)]
    assert by_acceptance == sorted(by_acceptance, reverse=True) and by_acceptance[-1] == 0
    # each draft pays for itself: the k-th is accepted with probability a**k, above the cost bar
    assert policy.num_drafts(0.5, 8, 1) == 4  # 0.5**4 > 0.05 > 0.5**5
    assert SpeculationPolicy(is_always=True).num_drafts(0.0, 8, 64) == 8
    assert policy.num_drafts(0.9, 0, 1) == 0


def test_a_request_that_stops_drafting_tries_again_later():
    policy = SpeculationPolicy(position_cost=0.3)
    stats = DraftStats(policy.prior_acceptance)
    for _ in range(10):
        stats.observe(policy, 4, 0)
    assert policy.num_drafts(stats.acceptance, 4, 1) == 0
    steps = 0
    while policy.num_drafts(stats.acceptance, 4, 1) == 0:
        stats.observe(policy, 0, 0)
        steps += 1
    assert 10 < steps < 200


def test_the_policy_at_work_in_a_busy_batch():
    # a runtime whose verification costs as much as a step per position never drafts beside busy seats
    runtime = speculating(position_cost=1.0)
    eng = engine(runtime, max_batch_size=4)
    handles = [eng.submit(RequestSpec(prompt=p, params=GREEDY)) for p in PROMPTS[:4]]
    [h.result() for h in handles]
    eng.shutdown()
    busy = [st for st in runtime.steps if sum(s.is_sampling for s in st.seqs) >= 2]
    assert busy and not any(s.num_draft_tokens for st in busy for s in st.seqs)


@pytest.mark.parametrize("k", [0, 17, -1])
def test_k_outside_1_to_16_is_refused(k):
    with pytest.raises(ValueError, match="K must be between 1 and 16"):
        check_max_num_drafts(k)


def test_counters_by_position():
    c = SpeculationCounters(3)
    c.record_step([(3, 1), (0, 0), (2, 2)])
    snap = c.snapshot()
    assert snap["steps_drafted"] == 1 and snap["drafted"] == 5 and snap["accepted"] == 3
    assert snap["drafted_by_position"] == [2, 2, 1] and snap["accepted_by_position"] == [2, 1, 0]
